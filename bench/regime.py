"""One regime of `make bench`: every layout started at once, every cell measured with the
layouts taking turns round by round, the capacity curve on the same servers, all stopped."""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from bench.device_regime import SIM_OPTIONS, Regime
from bench.http_load import HttpEndpoint
from bench.load import Batch, Call, Endpoint, prompts, requests_for, run_batch
from bench.report import add_ratios, run_record
from bench.settings import DEV_KEY, HTTP_LAYOUTS, RATE_LIMIT_OFF, TURN_WARMUP, Settings, in_cell
from bench.targets import (
    MIDDLEWARE_UNBATCHED_OVERLAY,
    REMOTE_BATCHED_OVERLAY,
    UNBATCHED_OVERLAY,
    Target,
    keep_load_generator_off,
    launch,
    server_cpu,
    thread_cpu_by_group,
)
from runtime.config.file import load_config, merge
from runtime.config.served_model import model_overrides, preflight
from spine.tools.tree_sampler import TreeSampler


def write_configs(run_dir: Path, model: str | None = None, model_id: str | None = None,
                  extra: Mapping[str, Any] | None = None) -> dict[str, Path]:
    """The config file each layout is started with (an overlay for `spine --config`, merged for bare);
    `extra` goes over it (the device regime's batch size), and `model` "sim" serves the simulator
    with the device regime's options."""
    sim_options = SIM_OPTIONS if model == "sim" else None
    base = merge(RATE_LIMIT_OFF, model_overrides(model, model_id, sim_options=sim_options)) if model else RATE_LIMIT_OFF
    base = merge(base, dict(extra)) if extra else base
    overlay = run_dir / "bench-overlay.yaml"
    overlay.write_text(yaml.safe_dump(base))
    unbatched = run_dir / "bench-overlay-unbatched.yaml"
    unbatched.write_text(yaml.safe_dump(merge(base, UNBATCHED_OVERLAY)))
    middleware_unbatched = run_dir / "bench-overlay-middleware-unbatched.yaml"
    middleware_unbatched.write_text(yaml.safe_dump(merge(base, MIDDLEWARE_UNBATCHED_OVERLAY)))
    remote_batched = run_dir / "bench-overlay-remote-batched.yaml"
    remote_batched.write_text(yaml.safe_dump(merge(base, REMOTE_BATCHED_OVERLAY)))
    merged = run_dir / "bench-config.yaml"
    config = load_config(overlay)
    preflight(config)  # a model directory that cannot be served: one line, before any server starts
    merged.write_text(config.to_yaml())
    return {"bare": merged, "collapsed": overlay, "collapsed-unbatched": unbatched,
            "collapsed-middleware-unbatched": middleware_unbatched, "layered": overlay,
            "layered-batched": remote_batched}


def start_all(run_dir: Path, settings: Settings, console: Console,
              extra: Mapping[str, Any] | None = None) -> dict[str, Target]:
    """Launch every layout at once (they start in parallel), then wait for each to be ready."""
    configs = write_configs(run_dir, settings.model, settings.model_id, extra)
    targets: dict[str, Target] = {}
    try:
        for layout in settings.layouts:
            targets[layout] = launch(layout, run_dir, configs[layout])
        for layout, target in targets.items():
            with console.status(f"waiting for {layout} to be ready"):
                target.wait_ready(settings.ready_timeout_s)
            console.print(f"{layout}: ready on {target.address} ({len(target.tree())} process(es))")
    except BaseException:
        stop_all(targets, console)
        raise
    return targets


def stop_all(targets: dict[str, Target], console: Console) -> list[int]:
    """Stop every target by PID; return the PIDs (ours) still alive afterwards, if any."""
    left: list[int] = []
    for target in targets.values():
        try:
            target.stop()
        except Exception as error:  # keep stopping the others
            console.print(f"[red]stopping {target.layout} failed: {error}[/red]")
        left.extend(target.alive_pids())
    return left


def tear_down(sampler: TreeSampler | None, endpoints: Mapping[str, Any], targets: dict[str, Target],
              console: Console) -> list[int]:
    """Stop sampling, close the clients, stop every server; the PIDs (ours) still alive, said aloud."""
    if sampler is not None:
        sampler.stop()
    for endpoint in endpoints.values():
        endpoint.close()
    left = stop_all(targets, console)
    if left:
        console.print(f"[red]processes still running after stop: {left}[/red]")
    return left


def warm_up(endpoints: Mapping[str, Any], settings: Settings) -> None:
    """First calls pay for connection set-up, lazy imports and first-shape kernels: not measured."""
    top = max(settings.concurrency)
    for layout, endpoint in endpoints.items():
        texts = prompts(f"warm-{layout}", settings.warmup + 2 + top)
        reqs = requests_for(texts, settings.max_tokens, settings.model_id)
        run_batch(endpoint, reqs[:settings.warmup], concurrency=1, time_limit_s=60)
        run_batch(endpoint, reqs[settings.warmup:settings.warmup + 2], concurrency=1, stream=True, time_limit_s=60)
        run_batch(endpoint, reqs[settings.warmup + 2:], concurrency=top, time_limit_s=60)


def measure(endpoints: Mapping[str, Any], measured: Mapping[str, Target], sampler: TreeSampler, settings: Settings,
            console: Console, *, stream: bool = True) -> list[dict[str, Any]]:
    """Every cell, its rounds interleaved across layouts; one run record per (cell, layout):
    `measured` is the server behind each endpoint, `sampler` samples their trees."""
    cells = [("unary", c, settings.cell_requests(c)) for c in settings.concurrency]
    if stream:
        cells.append(("stream", 1, settings.stream_requests))
    runs: list[dict[str, Any]] = []
    for mode, concurrency, count in cells:
        layouts = [layout for layout in endpoints if in_cell(layout, mode, concurrency)]
        rounds = settings.cell_rounds(concurrency, count)
        per_round = [count // rounds + (1 if r < count % rounds else 0) for r in range(rounds)]
        calls: dict[str, list[Call]] = {layout: [] for layout in layouts}
        wall = dict.fromkeys(layouts, 0.0)
        cpu = dict.fromkeys(layouts, 0.0)
        by_thread: dict[str, Counter[str]] = {layout: Counter() for layout in layouts}
        unsent = dict.fromkeys(layouts, 0)
        round_rps: dict[str, list[float]] = {layout: [] for layout in layouts}
        stepped: dict[str, list[float]] = {layout: [0.0, 0.0] for layout in layouts}  # sequences, steps
        round_limit = settings.cell_limit_s(concurrency, count) / rounds
        start = 0
        with console.status(f"{mode} at concurrency {concurrency}: {count} requests per layout in {rounds} rounds"):
            for r, size in enumerate(per_round):
                # The same prompts for every layout; the HTTP pseudo-layouts get prompts of their
                # own, of the same length (their server answered the gRPC ones: cache hits).
                texts = {side: prompts(f"{side}{mode[0]}{concurrency}", size, start) for side in "gh"}
                start += size
                reqs_by_side = {side: requests_for(texts[side], settings.max_tokens, settings.model_id)
                                for side in "gh"}
                order = layouts[r % len(layouts):] + layouts[:r % len(layouts)]  # rotate who goes first
                for layout in order:
                    reqs = reqs_by_side["h" if layout in HTTP_LAYOUTS else "g"]
                    # Its turn starts on caches the other layouts' turns have emptied: a few
                    # requests first, not measured (see TURN_WARMUP).
                    turn = requests_for(prompts(f"turn-{mode[0]}{concurrency}-{r}-{layout}", TURN_WARMUP),
                                        settings.max_tokens, settings.model_id)
                    run_batch(endpoints[layout], turn, concurrency=1, stream=mode == "stream", time_limit_s=5.0)
                    steps_before = measured[layout].model_steps()  # outside the CPU reading
                    sampler.measuring(layout, f"{layout}/{mode}/{concurrency}")
                    cpu_before = measured[layout].tree_cpu_s()
                    threads_before = measured[layout].tree_thread_cpu_s()
                    batch: Batch = run_batch(endpoints[layout], reqs, concurrency=concurrency,
                                             stream=mode == "stream", time_limit_s=round_limit)
                    cpu[layout] += measured[layout].tree_cpu_s() - cpu_before
                    by_thread[layout].update(thread_cpu_by_group(threads_before,
                                                                 measured[layout].tree_thread_cpu_s()))
                    sampler.measuring(layout, None)
                    steps_after = measured[layout].model_steps()
                    for i in (0, 1):
                        stepped[layout][i] += steps_after[i] - steps_before[i]
                    calls[layout].extend(batch.calls)
                    round_rps[layout].append(sum(call.ok for call in batch.calls) / batch.wall_s if batch.wall_s > 0 else 0.0)
                    wall[layout] += batch.wall_s
                    unsent[layout] += batch.unsent
        for layout in layouts:
            peak = sampler.peak_by_label.get(f"{layout}/{mode}/{concurrency}", 0)
            record = run_record(layout, mode, concurrency, calls[layout], wall[layout], unsent[layout], peak,
                                cpu_s=cpu[layout], cpu_by_thread_s=dict(by_thread[layout]),
                                round_rps=round_rps[layout], model_stepped=(stepped[layout][0], stepped[layout][1]))
            runs.append(record)
            console.print(f"  {mode:6} c={concurrency:<3} {layout:9} p50 {record['p50_ms']:8.2f} ms  "
                          f"p99 {record['p99_ms']:8.2f} ms  {record['rps']:7.1f} rps  errors {record['errors']}")
    return runs


def run_regime(settings: Settings, console: Console, keep: bool, *, extra: Mapping[str, Any] | None = None,
               http: bool = True, capacity: bool = False) -> Regime:
    """Start `settings.layouts` (and their HTTP pseudo-layouts with `http`), measure every cell
    and, with `capacity`, the open-loop capacity curve on the same servers; stop them all."""
    run_dir = Path(tempfile.mkdtemp(prefix="spb-"))  # short: unix socket paths are limited to ~107 bytes
    targets: dict[str, Target] = {}
    endpoints: dict[str, Any] = {}
    sampler: TreeSampler | None = None
    curve: dict[str, Any] | None = None
    try:
        targets = start_all(run_dir, settings, console, extra)
        keep_load_generator_off(server_cpu())
        processes = {layout: len(target.tree()) for layout, target in targets.items()}
        endpoints = {layout: Endpoint(t.address, t.is_gateway, DEV_KEY) for layout, t in targets.items()}
        for http_layout, layout in HTTP_LAYOUTS.items():  # the same server, called over HTTP
            address = targets[layout].http_address if layout in targets and http else None
            if address:
                endpoints[http_layout] = HttpEndpoint(address, DEV_KEY)
                processes[http_layout] = processes[layout]
        measured = {**targets, **{http_layout: targets[layout] for http_layout, layout in HTTP_LAYOUTS.items()
                                  if http_layout in endpoints}}
        sampler = TreeSampler({name: target.pid for name, target in measured.items()}, interval_s=0.25).start()
        with console.status("warming up"):
            warm_up(endpoints, settings)
        runs = measure(endpoints, measured, sampler, settings, console)
        comparisons = add_ratios(runs)
        for run in runs:
            run["layout_peak_rss_mb"] = round(sampler.peak_rss.get(run["layout"], 0) / (1024 * 1024), 1)
            run["processes"] = processes[run["layout"]]
        if capacity:
            from bench.capacity import measure_capacity

            def said(layout: str, point: Any) -> None:
                console.print(f"  capacity {layout:9} offered {point.offered_rps:7.1f} rps  p99 {point.p99_ms:8.2f} ms  "
                              f"answered {point.answered_rps:7.1f} rps  errors {point.errors}  "
                              f"server CPU {point.cpu_us_per_request} us/request")

            with console.status("open-loop capacity curve"):
                curve = measure_capacity({layout: endpoints[layout] for layout in targets},
                                         {layout: target.tree_cpu_s for layout, target in targets.items()},
                                         model_id=settings.model_id, step_s=settings.capacity_step_s,
                                         base_step_s=2 * settings.capacity_step_s, report=said)
    finally:
        left = tear_down(sampler, endpoints, targets, console)
        if keep:
            console.print(f"run directory kept: {run_dir}")
        else:
            shutil.rmtree(run_dir, ignore_errors=True)
    return Regime(runs, comparisons, left, curve)
