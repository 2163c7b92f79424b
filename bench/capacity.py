"""The open-loop capacity curve: how many requests per second a layout admits before its own
CPU, not the device, sets its latency.

A closed-loop bench (bench.load) never offers more than the server answers: a slow server
slows its clients down, and the requests a stall held back are never sent, so its tail is
hidden (coordinated omission). Here arrivals are a Poisson process at a fixed offered rate,
sent whether or not earlier answers are back, and a request is timed from its *scheduled*
start: a request the generator sent late is still charged the whole wait.

Each layout (same cores, same `sim` model with room to spare) is driven at rates rising
geometrically, the layouts taking turns at each rate so the host's slow spells land on all.
A rate *breaks* when its p99 exceeds `KNEE_FACTOR` × the p99 at the lowest rate, or any
request is refused or fails; the curve stops after `CONFIRM` breaking rates in a row (one
bad second of a shared host is not a knee), and the knee is the highest rate before them
that held. Reported per layout: the knee, the server's CPU per request there (its process
tree, the kernel's counters) and the p99 there; and a PNG of p99 against offered rate.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc

from bench.load import Endpoint, prompts, requests_for
from runtime.observability.stats import percentile
from spine.tools.workload.generator import open_loop, poisson_offsets

KNEE_FACTOR = 1.5
CONFIRM = 2  # breaking rates in a row before the curve stops
CONNECTIONS = 8  # connections per layout the arrivals are spread over


@dataclass(frozen=True)
class Point:
    """One offered rate against one layout."""

    offered_rps: float
    sent: int
    ok: int
    errors: int
    p50_ms: float
    p99_ms: float
    late_p99_ms: float  # how late the generator sent (already inside the latencies)
    answered_rps: float
    cpu_us_per_request: float | None


def rates(start_rps: float, growth: float, max_rps: float) -> list[float]:
    """start, start × growth, … up to max_rps (rounded to 0.1 rps)."""
    out, rate = [], start_rps
    while rate <= max_rps:
        out.append(round(rate, 1))
        rate *= growth
    return out


def breaks(point: Point, base_p99_ms: float, factor: float = KNEE_FACTOR) -> bool:
    """Whether a rate is past the knee: its p99 past `factor` × the low-load p99, or refusals."""
    return point.errors > 0 or point.ok == 0 or point.p99_ms > factor * base_p99_ms


def stopped(points: Sequence[Point], factor: float = KNEE_FACTOR, confirm: int = CONFIRM) -> bool:
    """Whether the last `confirm` rates all broke (the curve is done)."""
    if len(points) < confirm + 1:
        return False
    return all(breaks(p, points[0].p99_ms, factor) for p in points[-confirm:])


def knee(points: Sequence[Point], factor: float = KNEE_FACTOR, confirm: int = CONFIRM) -> Point | None:
    """The highest rate that held before the first run of `confirm` breaking rates (the last
    rate measured when the curve never broke); None when even the lowest rate broke."""
    if not points or breaks(points[0], points[0].p99_ms, factor):
        return None
    base = points[0].p99_ms
    held: Point | None = None
    for index, point in enumerate(points):
        run = points[index:index + confirm]
        if len(run) == confirm and all(breaks(p, base, factor) for p in run):
            return held
        if not breaks(point, base, factor):
            held = point
    return held


def send_open_loop(endpoint: Endpoint, requests: Sequence[Any], offsets: Sequence[float], *,
                   timeout_s: float = 10.0) -> tuple[list[float], list[str], list[float]]:
    """Send request i at offsets[i] (seconds from now) without waiting for answers (the
    workload's `open_loop`, each call a gRPC future); return the successful latencies from
    each scheduled start, the failed calls' codes and how late each was sent."""
    stubs = endpoint.stubs(CONNECTIONS)
    latencies: list[float] = []
    failures: list[str] = []
    late: list[float] = []
    lock = threading.Lock()
    done = threading.Semaphore(0)

    def finished(future: Any, scheduled: float) -> None:
        ended = time.monotonic()
        error = future.exception()
        with lock:
            if error is None:
                latencies.append(ended - scheduled)
            else:
                failures.append(error.code().name if isinstance(error, grpc.RpcError) else type(error).__name__)
        done.release()

    def release(index: int, scheduled: float) -> None:
        late.append(max(0.0, time.monotonic() - scheduled))
        call = stubs[index % len(stubs)].Generate.future(requests[index], timeout=timeout_s,
                                                         metadata=endpoint.metadata)
        call.add_done_callback(lambda future: finished(future, scheduled))

    sent = open_loop(offsets, release, started=time.monotonic() + 0.01)
    for _ in range(sent):  # every call ends by its own deadline
        done.acquire(timeout=timeout_s + 5)
    return latencies, failures, late


def measure_point(endpoint: Endpoint, rate_rps: float, duration_s: float, *, model_id: str, max_tokens: int,
                  tag: str, cpu_s: Callable[[], float], seed: int = 0) -> Point:
    """One rate against one layout: Poisson arrivals for `duration_s`, every answer awaited."""
    offsets = poisson_offsets(rate_rps, duration_s, random.Random(f"{seed}-{rate_rps}"))
    requests = requests_for(prompts(tag, len(offsets)), max_tokens, model_id)
    cpu_before, began = cpu_s(), time.perf_counter()
    latencies, failures, late = send_open_loop(endpoint, requests, offsets)
    wall, cpu = time.perf_counter() - began, cpu_s() - cpu_before
    ms = [1000.0 * value for value in latencies]
    return Point(offered_rps=rate_rps, sent=len(offsets), ok=len(latencies), errors=len(failures),
                 p50_ms=round(percentile(ms, 50), 3) if ms else math.nan,
                 p99_ms=round(percentile(ms, 99), 3) if ms else math.nan,
                 late_p99_ms=round(percentile([1000.0 * v for v in late], 99), 3) if late else 0.0,
                 answered_rps=round(len(latencies) / wall, 2) if wall > 0 else 0.0,
                 cpu_us_per_request=round(1e6 * cpu / len(latencies), 1) if latencies else None)


def measure_capacity(endpoints: Mapping[str, Endpoint], cpu_s: Mapping[str, Callable[[], float]], *,
                     model_id: str, max_tokens: int = 4, start_rps: float = 25.0, growth: float = 1.3,
                     max_rps: float = 3000.0, step_s: float = 2.5, base_step_s: float = 5.0,
                     report: Callable[[str, Point], None] | None = None) -> dict[str, Any]:
    """Every layout's curve, the layouts taking turns at each rate; per layout its knee, the
    server CPU per request and the p99 there, and every point (`curve`)."""
    curves: dict[str, list[Point]] = {layout: [] for layout in endpoints}
    active = list(endpoints)
    for step, rate in enumerate(rates(start_rps, growth, max_rps)):
        if not active:
            break
        order = active[step % len(active):] + active[:step % len(active)]
        for layout in order:
            point = measure_point(endpoints[layout], rate, base_step_s if step == 0 else step_s,
                                  model_id=model_id, max_tokens=max_tokens, tag=f"cap-{layout}-{step}",
                                  cpu_s=cpu_s[layout])
            curves[layout].append(point)
            if report is not None:
                report(layout, point)
        active = [layout for layout in active if not stopped(curves[layout])]
    out: dict[str, Any] = {}
    for layout, points in curves.items():
        at = knee(points)
        out[layout] = {"knee_rps": at.offered_rps if at else None,
                       "cpu_us_per_request": at.cpu_us_per_request if at else None,
                       "p99_ms_at_knee": at.p99_ms if at else None,
                       "low_load_p99_ms": points[0].p99_ms if points else None,
                       "curve_ended": "broke" if stopped(points) else "max_rps",
                       "curve": [asdict(point) for point in points]}
    return out


def plot_capacity(capacity: Mapping[str, Any], out: Path, title: str = "") -> Path | None:
    """p99 against offered rate per layout, the knee marked; None when there is nothing to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = {layout: entry["curve"] for layout, entry in capacity.items() if entry.get("curve")}
    if not curves:
        return None
    figure, axes = plt.subplots(figsize=(7.5, 4.5))
    for layout, points in curves.items():
        line = axes.plot([p["offered_rps"] for p in points], [p["p99_ms"] for p in points], marker="o",
                         label=layout)[0]
        knee_rps = capacity[layout].get("knee_rps")
        if knee_rps is not None:
            axes.axvline(knee_rps, color=line.get_color(), linestyle=":", alpha=0.7)
        base = points[0]["p99_ms"]
        axes.axhline(KNEE_FACTOR * base, color=line.get_color(), linestyle="--", alpha=0.3)
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("offered rate (requests/s, Poisson arrivals)")
    axes.set_ylabel("p99 latency from scheduled start (ms)")
    axes.set_title(f"open-loop capacity: knee (dotted) where p99 > {KNEE_FACTOR}× low-load (dashed)", fontsize=9)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    if title:
        figure.suptitle(title, fontsize=8)
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out
