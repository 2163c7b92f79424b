"""The bench's `device` regime: the same layouts, serving the `sim` model.

The `cpu` regime serves the built-in model on this machine's CPU, on the core the spine's
middleware uses: the worst case, where every µs of middleware is one the model loses. The
`device` regime serves `sim` (`services.inference.model.sim_backend`), whose steps wait a GPU's time
off the CPU, as a real deployment's model thread waits on its CUDA stream. It asks whether
the middleware's CPU work hides behind the device's step, and (`bench.capacity`) how many
requests a second each layout admits before its own CPU, not the device, sets its latency.

Its cells are smaller than the cpu regime's: one request at concurrency 1 takes ~60 ms of
device time (BOS + prompt prefill, then 8 decode steps of ~6.5 ms), so 1000 of them would
be a minute per layout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console

from runtime.config.served_model import model_id_for

DEVICE_LAYOUTS = ("bare", "collapsed", "layered")
DEVICE_SEQUENTIAL_REQUESTS = 300
DEVICE_STREAM_REQUESTS = 200
# Seconds per cell and layout (half the cpu regime's): the layered stack is the slowest here
# at high concurrency, so its turns set the cells' length, and with the cpu regime's limit the
# regime and its capacity curve did not fit `make bench`'s time beside the cpu regime.
DEVICE_CELL_LIMIT_S = 10.0
# The sim's options in the device regime: the default profile (Llama-3-8B on an H100) with
# a context of 1024 tokens, so its KV budget holds 419 sequences; and a batch of up to 256,
# so that c=256 runs in one batch, as vLLM would run it, not in a queue.
SIM_OPTIONS: dict[str, Any] = {"max_context": 1024}
DEVICE_OVERLAY: dict[str, Any] = {"inference": {"max_batch": 256, "max_queue": 2048}}
# Targets (the issue's), device regime: collapsed over bare.
RPS_MIN, RPS_AT = 0.98, ("16", "64", "256")
P50_MAX, P99_MAX, LATENCY_AT = 1.02, 1.05, ("1", "16", "64")
TTFT_MAX, LAYERED_CPU_MIN, KNEE_RATIO_MIN = 1.03, 2.0, 3.0


@dataclass
class Regime:
    """What one regime's servers measured."""

    runs: list[dict[str, Any]]
    comparisons: list[dict[str, Any]]
    left: list[int]
    capacity: dict[str, Any] | None = None
    profile: str = ""


def profile_name(settings: Any) -> str:
    """The sim profile's name, or what the device regime serves instead (`--device-model DIR`)."""
    if settings.device_model:
        return f"hf:{settings.device_model}"
    from services.inference.model.sim_backend import profile_from  # torch: after the entry point's settings

    return profile_from(SIM_OPTIONS).name


def device_settings(settings: Any) -> Any:
    """The cpu regime's settings turned to the device regime's (a `bench.run.Settings`)."""
    scaled = settings.scale_with_concurrency  # no --requests given: the device regime's own sizes
    model = settings.device_model or "sim"
    return replace(settings, layouts=DEVICE_LAYOUTS, model=model, model_id=model_id_for(model),
                   cell_time_limit_s=min(settings.cell_time_limit_s, DEVICE_CELL_LIMIT_S),
                   sequential_requests=DEVICE_SEQUENTIAL_REQUESTS,
                   stream_requests=min(settings.stream_requests, DEVICE_STREAM_REQUESTS) if scaled
                   else settings.stream_requests)


def _cpu_us(runs: Sequence[Mapping[str, Any]], layout: str) -> float | None:
    """Server CPU per answered request over every unary cell of `layout` (its process tree)."""
    cpu_ms = answered = 0.0
    for run in runs:
        if run["layout"] == layout and run["mode"] == "unary" and run.get("cpu_ms_per_request") is not None:
            ok = run["requests"] - run["errors"]
            cpu_ms += run["cpu_ms_per_request"] * ok
            answered += ok
    return round(1000.0 * cpu_ms / answered, 1) if answered else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def summarize(runs: Sequence[Mapping[str, Any]], capacity: Mapping[str, Any] | None,
              profile: str = "") -> dict[str, Any]:
    """results.json's `device_regime`: collapsed over bare per concurrency, TTFT, CPU per request."""
    collapsed = {str(r["concurrency"]): {"p50": r.get("p50_vs_bare"), "p99": r.get("p99_vs_bare"),
                                         "rps": r.get("rps_vs_bare")}
                 for r in runs if r["layout"] == "collapsed" and r["mode"] == "unary"}
    stream = {r["layout"]: r for r in runs if r["mode"] == "stream"}
    ttft = None
    if "collapsed" in stream and "bare" in stream:
        ttft = _ratio(stream["collapsed"].get("ttft_p50_ms"), stream["bare"].get("ttft_p50_ms"))
    cpu = {layout: _cpu_us(runs, layout) for layout in DEVICE_LAYOUTS}
    if not profile:
        from services.inference.model.sim_backend import profile_from

        profile = profile_from(SIM_OPTIONS).name
    return {"profile": profile, "collapsed_vs_bare": collapsed, "ttft_collapsed_vs_bare": ttft,
            "cpu_us_per_request": cpu, "targets": targets_met(collapsed, ttft, cpu, capacity)}


def targets_met(collapsed: Mapping[str, Mapping[str, float | None]], ttft: float | None,
                cpu: Mapping[str, float | None], capacity: Mapping[str, Any] | None) -> dict[str, bool | None]:
    """Each target of the issue: met, missed, or None where this run did not measure it."""

    def at_most(value: float | None, limit: float) -> bool | None:
        return None if value is None else value <= limit

    def at_least(value: float | None, limit: float) -> bool | None:
        return None if value is None else value >= limit

    out: dict[str, bool | None] = {}
    for c in RPS_AT:
        out[f"rps_c{c}"] = at_least(collapsed.get(c, {}).get("rps"), RPS_MIN)
    for c in LATENCY_AT:
        out[f"p50_c{c}"] = at_most(collapsed.get(c, {}).get("p50"), P50_MAX)
        out[f"p99_c{c}"] = at_most(collapsed.get(c, {}).get("p99"), P99_MAX)
    out["ttft"] = at_most(ttft, TTFT_MAX)
    out["layered_over_collapsed_cpu"] = at_least(_ratio(cpu.get("layered"), cpu.get("collapsed")), LAYERED_CPU_MIN)
    knees = {layout: (capacity or {}).get(layout, {}).get("knee_rps") for layout in ("collapsed", "layered")}
    out["collapsed_over_layered_knee"] = at_least(_ratio(knees["collapsed"], knees["layered"]), KNEE_RATIO_MIN)
    return out


def capacity_summary(capacity: Mapping[str, Any]) -> dict[str, Any]:
    """results.json's `capacity`: per layout its knee, CPU per request and p99 there."""
    keys = ("knee_rps", "cpu_us_per_request", "p99_ms_at_knee")
    return {layout: {key: entry.get(key) for key in keys} for layout, entry in capacity.items()}


def device_results(device: Regime | None) -> dict[str, Any]:
    """results.json's device keys: every run of the device regime, its summary and the capacity curve."""
    if device is None:
        return {}
    return {"device_runs": device.runs, "device_layered_vs_collapsed": device.comparisons,
            "device_regime": summarize(device.runs, device.capacity, device.profile),
            "capacity": capacity_summary(device.capacity) if device.capacity is not None else None,
            "capacity_curve": device.capacity}


def print_device(results: Mapping[str, Any], console: Console, out: Path) -> None:
    """The device regime's summary lines, and the capacity PNG beside results.json."""
    from bench.report import print_tables

    print_tables({"runs": results["device_runs"], "settings": results["settings"], "machine": results["machine"],
                  "layered_vs_collapsed": results["device_layered_vs_collapsed"]}, console)
    summary = results["device_regime"]
    console.print(f"device regime ({summary['profile']}): collapsed/bare {summary['collapsed_vs_bare']}; "
                  f"TTFT {summary['ttft_collapsed_vs_bare']}; server CPU us/request {summary['cpu_us_per_request']}")
    console.print(f"targets: {summary['targets']}")
    if results.get("capacity_curve"):
        from bench.capacity import plot_capacity

        machine = results.get("machine", {})
        png = plot_capacity(results["capacity_curve"], out.with_name(out.stem + "-capacity.png"),
                            f"sim {summary['profile']}; {machine.get('cpu_count', '?')} CPUs, load average at start "
                            f"{machine.get('loadavg_device_start')}")
        console.print(f"capacity: {results['capacity']}{f' (plot {png})' if png else ''}")
