"""Run one workload through several layouts, interleaved, and measure each.

Each layout is started once, in a process tree of its own (`spine.tools.ab.serve`), so CPU
seconds and memory belong to it. Then every request goes to every layout, interleaved in
an order that rotates, so that whatever else the machine is doing hits every layout alike,
and every layout sees the same requests in the same order (the same rate-limit and cache
state, so decisions can be compared).

Closed loop: rounds of requests, each layout alone at the whole concurrency for a round,
the order rotating (`_closed_loop` says why not every request to every layout in turn).
Open loop: requests are released at their arrival offsets (Poisson for synthetic
workloads) to every layout at once, and latency counts from the scheduled arrival, so a
layout that falls behind is charged for the queueing it causes.

Every run is bounded: by the workload's count, by `time_limit_s` (no request starts
after it), and per request by `timeout_s`. A layout that does not come up, or stops answering health checks, is
reported as down and left out rather than waited on. While the workload runs each layout's gateway health is
watched (every 0.5 s, each check within 0.5 s, a late one asked again): requests meant for a layout that is not
SERVING — a fail-closed component of it dead, hung or not serving — are not sent to it but counted
(`not_serving`), so a broken layout loses its traffic within a second or so instead of timing every request out.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.config.model import SpineConfig
from runtime.config.sections import TlsConfig
from runtime.health.watch import HealthWatch
from runtime.processes.launch import Launched, LaunchFailed, events, launch
from runtime.processes.run_dir import write_private
from runtime.server import wait_serving
from runtime.tls import link_credentials
from spine.client.gateway_client import CallResult, GatewayClient
from spine.tools.ab.serve import RESULT_FILE
from spine.tools.tree_sampler import TreeSampler, tree_cpu_seconds
from spine.tools.workload.generator import Entry, Item, closed_loop, open_loop

ResultCallback = Callable[[str, int, CallResult], None]
Serving = Callable[[str], bool]  # a layout's name -> is its gateway SERVING now


class LayoutDown(RuntimeError):
    """A layout that could not be started or reached (the message says why)."""


@dataclass(frozen=True)
class RunOptions:
    mode: str = "closed"            # "closed" (at a concurrency) or "open" (at the arrival offsets)
    concurrency: int = 4
    time_limit_s: float = 60.0
    timeout_s: float = 10.0
    warmup: int = 4                 # requests per layout before measuring (not reported)
    health_timeout_s: float = 5.0
    start_timeout_s: float = 120.0
    max_open_workers: int = 64

    def __post_init__(self) -> None:
        if self.mode not in ("closed", "open"):
            raise ValueError(f"mode: must be 'closed' or 'open', got {self.mode!r}")
        if not 1 <= self.concurrency <= 1024:
            raise ValueError(f"concurrency: must be from 1 to 1024, got {self.concurrency}")
        if self.time_limit_s <= 0 or self.timeout_s <= 0:
            raise ValueError(f"time_limit_s and timeout_s must be > 0, got {self.time_limit_s} and {self.timeout_s}")


@dataclass
class LayoutRun:
    """One layout's part of a run: where it was, whether it was up, what it did."""

    name: str
    address: str | None = None
    status: str = "up"              # "up" | "down"
    error: str = ""
    root_pid: int | None = None
    results: list[CallResult | None] = field(default_factory=list)
    not_serving: int = 0            # requests not sent because the layout was not SERVING
    scheduled_latency_s: list[float | None] = field(default_factory=list)
    cpu_s: float | None = None
    peak_rss_bytes: int | None = None
    device_bytes: int | None = None
    spans: dict[str, dict[str, float]] = field(default_factory=dict)
    tls: TlsConfig | None = None    # the config's `tls:`: the layout is called over mTLS with its certificate

    def client(self) -> GatewayClient:
        address = str(self.address)
        return GatewayClient(address, credentials=link_credentials(self.tls, address))


# -- a layout in its own process tree ------------------------------------------------
class LayoutProcess:
    """`python -m spine.tools.ab.serve` for one layout (`runtime.processes.launch`); stops with its tree."""

    def __init__(self, layout: str, config_path: Path, run_dir: Path, trace_ratio: float = 1.0) -> None:
        self.layout = layout
        self.config_path = config_path
        self.run_dir = run_dir
        self.trace_ratio = trace_ratio
        self.launched: Launched | None = None
        self.address: str | None = None

    def start(self, timeout_s: float) -> str:
        self.spawn()
        return self.await_ready(timeout_s)

    def spawn(self) -> None:
        """Start the process. Call from a thread that outlives it: the child asks Linux to
        SIGTERM it when the thread that spawned it exits (PR_SET_PDEATHSIG)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.launched = launch(
            f"{self.layout} layout",
            [sys.executable, "-m", "spine.tools.ab.serve", "--layout", self.layout, "--config", str(self.config_path),
             "--run-dir", str(self.run_dir), "--trace-ratio", str(self.trace_ratio)],
            log_path=self.run_dir / "serve.log", stdin=True)

    def await_ready(self, timeout_s: float) -> str:
        """The Gateway address once the layout says it is ready; `LayoutDown` otherwise."""
        assert self.launched is not None, "spawn() first"
        try:
            ready = self.launched.wait_ready(timeout_s)
        except LaunchFailed as error:
            raise LayoutDown(str(error)) from None
        self.address = str(ready["address"])
        return self.address

    @property
    def pid(self) -> int | None:
        return self.launched.pid if self.launched is not None else None

    def forget_warm_up(self, timeout_s: float = 5.0) -> bool:
        """Ask the layout to drop the spans measured so far; True once it says it has."""
        launched = self.launched
        if launched is None or not launched.alive():
            return False
        try:
            launched.send("reset")
        except OSError:
            return False
        return launched.wait_for(events("reset"), timeout_s) is not None

    def stop(self, timeout_s: float = 20.0) -> dict[str, Any]:
        """SIGTERM the tree's root (it stops its children), wait, and read what it measured."""
        launched, self.launched = self.launched, None
        if launched is None:
            return {}
        launched.stop(timeout_s)
        path = self.run_dir / RESULT_FILE
        try:
            result: dict[str, Any] = json.loads(path.read_text())
            return result
        except (OSError, ValueError):
            return {}


# -- sending the workload -----------------------------------------------------------------
def _send(client: GatewayClient, item: Item, timeout_s: float) -> CallResult:
    headers = dict(item.headers)
    if item.stream:
        return client.stream(item.request, token=item.token or "", timeout=timeout_s, headers=headers)
    return client.generate(item.request, token=item.token or "", timeout=timeout_s, headers=headers)


def run_interleaved(runs: Sequence[LayoutRun], entries: Sequence[Entry], options: RunOptions,
                    on_result: ResultCallback | None = None, serving: Serving | None = None) -> float:
    """Send every entry to every layout in `runs` (those up) while `serving(name)` says it is
    SERVING (else count it in `not_serving`); fills their results; the wall seconds."""
    live = [run for run in runs if run.status == "up" and run.address]
    for run in live:
        run.not_serving = 0
    for run in live:
        run.results = [None] * len(entries)
        run.scheduled_latency_s = [None] * len(entries)
    if not live:
        return 0.0
    started = time.monotonic()
    deadline = started + options.time_limit_s
    lock = threading.Lock()

    def sendable(run: LayoutRun) -> bool:
        if serving is None or serving(run.name):
            return True
        with lock:
            run.not_serving += 1
        return False

    if options.mode == "closed":
        _closed_loop(live, entries, options, deadline, on_result, sendable)
    else:
        _open_loop(live, entries, options, started, deadline, on_result, sendable)
    return time.monotonic() - started


# A closed-loop round: this many requests per worker, sent to one layout alone.
ROUND_PER_WORKER = 4


def _closed_loop(live: Sequence[LayoutRun], entries: Sequence[Entry], options: RunOptions, deadline: float,
                 on_result: ResultCallback | None, sendable: Callable[[LayoutRun], bool]) -> None:
    """Rounds of `concurrency × ROUND_PER_WORKER` requests, each layout alone in turn at the
    whole concurrency, the order rotating every round.

    Why rounds: with each worker sending a request to every layout in turn, workers pile
    up at whichever layout is slower at the moment, so it runs at more than the concurrency
    asked and gets slower still, while the layouts fight over the same cores. On a small
    host at high concurrency that even reversed which layout read faster; in rounds the
    order is the one `make bench` finds with each layout alone.
    Alternating rounds keeps the point of interleaving (a slow patch of the machine hits
    every layout alike) and gives each layout exactly the concurrency asked."""
    round_size = options.concurrency * ROUND_PER_WORKER
    clients = {run.name: [run.client() for _ in range(options.concurrency)] for run in live}
    try:
        for number, first in enumerate(range(0, len(entries), round_size)):
            indices = range(first, min(first + round_size, len(entries)))
            shift = number % len(live)
            for run in [*live[shift:], *live[:shift]]:
                if time.monotonic() >= deadline:
                    return
                _closed_round(clients[run.name], run, entries, indices, options, deadline, on_result, sendable)
    finally:
        for layout_clients in clients.values():
            for client in layout_clients:
                client.close()


def _closed_round(clients: Sequence[GatewayClient], run: LayoutRun, entries: Sequence[Entry], indices: range,
                  options: RunOptions, deadline: float, on_result: ResultCallback | None,
                  sendable: Callable[[LayoutRun], bool]) -> None:
    """One layout, one round: each worker takes the round's next request until none is left."""

    def send(client: GatewayClient, at: int) -> None:
        index = indices[at]
        if not sendable(run):
            return
        result = _send(client, entries[index].item, options.timeout_s)
        run.results[index] = result
        run.scheduled_latency_s[index] = result.latency_s
        if on_result is not None:
            on_result(run.name, index, result)

    closed_loop(len(indices), clients, send, options.time_limit_s, deadline=deadline)


def _open_loop(live: Sequence[LayoutRun], entries: Sequence[Entry], options: RunOptions, started: float,
               deadline: float, on_result: ResultCallback | None, sendable: Callable[[LayoutRun], bool]) -> None:
    clients = {run.name: run.client() for run in live}

    def send(run: LayoutRun, index: int, scheduled: float) -> None:
        if not sendable(run):
            return
        result = _send(clients[run.name], entries[index].item, options.timeout_s)
        run.results[index] = result
        run.scheduled_latency_s[index] = time.monotonic() - scheduled  # includes waiting for a worker
        if on_result is not None:
            on_result(run.name, index, result)

    workers = min(options.max_open_workers, max(options.concurrency, 2 * len(live)) * 4)
    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ab-open") as pool:
            def release(index: int, scheduled: float) -> None:  # to every layout, who goes first rotating
                for offset in range(len(live)):
                    pool.submit(send, live[(index + offset) % len(live)], index, scheduled)

            open_loop([entry.at for entry in entries], release, started=started, deadline=deadline)
    finally:
        for client in clients.values():
            client.close()


def warm_up(runs: Sequence[LayoutRun], token: str | None, count: int, timeout_s: float) -> None:
    """A few requests per layout so that first-call costs (imports, allocation) are not measured."""
    from wire.v1 import generation_pb2

    for run in runs:
        if run.status != "up" or not run.address or count <= 0:
            continue
        with run.client() as client:
            for index in range(count):
                request = generation_pb2.GenerateRequest(model="tiny-lm", prompt=f"warm up {index}", max_tokens=2)
                client.generate(request, token=token or "", timeout=timeout_s)


# -- the whole run ----------------------------------------------------------------------------
@dataclass
class ABRun:
    runs: list[LayoutRun]
    wall_s: float
    options: RunOptions


def run_ab(config: SpineConfig, layouts: Sequence[str], entries: Sequence[Entry], run_dir: Path, *,
           options: RunOptions | None = None, targets: Mapping[str, str] | None = None,
           trace_ratio: float = 1.0, warmup_token: str | None = None,
           on_status: Callable[[str], None] | None = None, on_result: ResultCallback | None = None,
           on_total: Callable[[int], None] | None = None) -> ABRun:
    """Start `layouts` (and reach `targets`: name -> running Gateway address), run, stop, measure."""
    options = options or RunOptions()
    say = on_status or (lambda message: None)
    config_path = write_private(run_dir, "config.yaml", config.to_yaml())
    runs: list[LayoutRun] = []
    processes: dict[str, LayoutProcess] = {}
    try:
        if layouts:
            say(f"starting the {', '.join(layouts)} layout{'s' if len(layouts) > 1 else ''}")
        for layout in layouts:
            processes[layout] = LayoutProcess(layout, config_path, run_dir / layout, trace_ratio)
            runs.append(LayoutRun(layout))

        for process in processes.values():
            process.spawn()  # from this thread, which outlives the run (see spawn)

        def start(run: LayoutRun) -> None:
            try:
                run.address = processes[run.name].await_ready(options.start_timeout_s)
                run.root_pid = processes[run.name].pid
            except LayoutDown as error:
                run.status, run.error = "down", str(error)

        with ThreadPoolExecutor(max_workers=max(1, len(runs)), thread_name_prefix="ab-start") as pool:
            list(pool.map(start, list(runs)))  # side by side: the slowest start bounds the wait
        for name, address in (targets or {}).items():
            runs.append(LayoutRun(name, address))
        tls = config.tls
        for run in runs:
            run.tls = tls
            if run.status == "up" and not wait_serving(str(run.address), options.health_timeout_s, tls=tls):
                run.status = "down"
                run.error = f"{run.name} at {run.address} is not SERVING (no healthy answer in " \
                            f"{options.health_timeout_s:g}s)"
        say("warming up")
        warm_up(runs, warmup_token, options.warmup, options.timeout_s)
        for run in runs:  # the warm-up's spans are not the workload's
            if run.status == "up" and run.name in processes and not processes[run.name].forget_warm_up():
                say(f"{run.name}: its spans still include the warm-up (no answer to reset)")
        measured = {run.name: run.root_pid for run in runs if run.status == "up" and run.root_pid}
        monitor = TreeSampler({name: pid for name, pid in measured.items() if pid is not None}, device=True)
        cpu_before = {name: tree_cpu_seconds(pid) for name, pid in measured.items() if pid is not None}
        monitor.start()
        live = sum(r.status == "up" for r in runs)
        say(f"sending {len(entries)} requests to {live} layouts")
        if on_total is not None:
            on_total(len(entries) * live)
        health = HealthWatch({run.name: str(run.address) for run in runs if run.status == "up" and run.address},
                             what="layout", tls=tls).start()
        try:
            wall = run_interleaved(runs, entries, options, on_result,
                                   serving=lambda name: health.serving.get(name, True))
        finally:
            health.stop()
            monitor.stop()
        for run in runs:
            if run.name in cpu_before and run.root_pid is not None:
                run.cpu_s = tree_cpu_seconds(run.root_pid) - cpu_before[run.name]
                run.peak_rss_bytes = monitor.peak_rss.get(run.name)
                run.device_bytes = monitor.peak_device.get(run.name)
    finally:
        say("stopping the layouts")
        stoppable = [run for run in runs if run.name in processes]
        with ThreadPoolExecutor(max_workers=max(1, len(stoppable)), thread_name_prefix="ab-stop") as pool:
            for run, measured_inside in zip(stoppable, pool.map(lambda r: processes[r.name].stop(), stoppable),
                                            strict=True):
                run.spans = measured_inside.get("spans") or {}
                inside_peak = measured_inside.get("device_peak_bytes")
                if inside_peak is not None and run.device_bytes is None:
                    run.device_bytes = int(inside_peak)
    return ABRun(runs, wall, options)

