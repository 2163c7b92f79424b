"""`make bench`: bare model service vs collapsed spine vs layered stack, in two regimes, in one run.

    python -m bench.run [--quick] [--concurrency 1,16,64] [--requests N] [--out bench/results.json]
                        [--regimes cpu,device] [--no-capacity]
                        [--model DIR [--model-id ID]]      (or SPINE_BENCH_MODEL=DIR make bench)
    python -m bench.run --only system_prompt,system_prompt_hf   (those rows alone, into --out)

Two regimes (`bench.device_regime`): `cpu`, the built-in model on this machine's CPU, on the
core the middleware runs on (every µs of middleware is one the model loses), and `device`,
the `sim` model whose steps wait a GPU's time off the CPU (does the middleware's CPU work
hide behind the device's step?). The device regime ends with the open-loop capacity curve
(`bench.capacity`): Poisson arrivals at rising rates until each layout's p99 breaks.

All three layouts are up at once, each in its own process(es), so the load generator
(this process) never shares a GIL with a server. Each cell (mode × concurrency) is cut
into rounds and the layouts take turns round by round, in a rotating order, so machine
noise (other jobs, thermal, GC) lands on all of them alike. Requests are greedy with
distinct prompts (no response-cache hits), so every call does the same model work.

`--model DIR` (default: $SPINE_BENCH_MODEL) serves a transformers causal LM directory in
every layout instead of the embedded tiny LM, as `spine up --model DIR` does.

Without --quick or --model, `real_model` is a real model's row (`bench.real_model`), and with the
embedded model `system_prompt` reports 100 requests sharing one system prompt,
with and without the prefix cache (`bench.serving.measure_system_prompt`); `system_prompt_hf`
the same on a tiny llama served by the transformers backend
(`bench.serving.measure_system_prompt_hf`). `--only` runs the named serving rows alone (a
few seconds each) and writes them into --out, keeping what else the file holds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from bench.device_regime import DEVICE_OVERLAY, SIM_OPTIONS, Regime, device_results, print_device
from bench.http_load import HttpEndpoint
from bench.load import Batch, Call, Endpoint, prompts, requests_for, run_batch
from bench.real_model import describe as describe_real_model
from bench.real_model import measure_real_model
from bench.report import add_ratios, batching_gain, http_vs_grpc, machine_info, print_tables, run_record
from bench.targets import (
    LAYOUTS,
    MIDDLEWARE_UNBATCHED_OVERLAY,
    QUICK_LAYOUTS,
    REMOTE_BATCHED_OVERLAY,
    UNBATCHED_OVERLAY,
    RssSampler,
    Target,
    TargetFailed,
    keep_load_generator_off,
    launch,
    server_cpu,
    thread_cpu_by_group,
)
from runtime.config import load_config, merge
from runtime.served_model import model_id_for, model_overrides, preflight
from services.common import ConfigError

DEV_KEY = "spine-dev-key-0000"
DEFAULT_OUT = Path(__file__).with_name("results.json")
REQUESTS_PER_WORKER = 25  # per unary cell, so each of the rounds keeps every worker busy
# And at least this many in a cell with many clients. At 16 clients 25 a worker made 400
# requests, rounds of 80: a quarter of a second of load per layout and turn, where a slow
# spell of the host lasts seconds, so a cell's ratio read whichever layout the spell hit;
# with more requests a round, the rounds' spread narrowed to what focused runs read.
CONCURRENT_REQUESTS = 1600
# One client sends one request at a time: its cell gets at least this many requests, cut into
# rounds of about `SEQUENTIAL_ROUND` (a third of a second per layout). A slow spell of the
# host lasts seconds; with five long rounds it landed on one layout more than another, and
# two identical spines in one run read clearly apart at c=1; in short rounds they agree
# within the noise.
SEQUENTIAL_REQUESTS = 1000
# Streamed requests per layout (one client): time to first token is a few ms with a long tail
# (p99 several times p50), and its median from a couple of hundred moved with the host, far
# from what focused runs of a thousand read in the same hour.
STREAM_REQUESTS = 600
SEQUENTIAL_ROUND = 40
SEQUENTIAL_BUDGET_S = 0.04  # per request of a cell: about twice what the layered layout takes at c=1
# Unmeasured requests at the start of every turn. Taking turns evens out the host's slow
# spells but adds a cost no server has in steady state: each turn starts on caches the five
# other layouts' turns have just used, and the more memory a layout touches per request, the
# more its first requests pay (with more layouts taking turns, collapsed/bare at c=1 read
# worse than with three).
TURN_WARMUP = 3
# The HTTP API (`runtime.http`), measured beside the gRPC path of the same server process:
# each pseudo-layout calls its layout's HTTP listener (a unix socket, as the gRPC one is) with
# the same prompts. Only in the cells its targets are stated for (p50 at c=1, throughput at
# c=64) and the stream cell (TTFT), to keep `make bench` within its time.
HTTP_LAYOUTS: dict[str, str] = {"collapsed-http": "collapsed", "layered-http": "layered"}
HTTP_CONCURRENCY = (1, 64)


# The serving rows `--only` may run alone (`bench.serving`).
ONLY_PARTS = ("serving", "system_prompt", "system_prompt_hf")


def in_cell(layout: str, mode: str, concurrency: int) -> bool:
    """Whether `layout` takes part in a cell (the HTTP pseudo-layouts only in theirs)."""
    return layout not in HTTP_LAYOUTS or mode == "stream" or concurrency in HTTP_CONCURRENCY


# The bench measures overhead, not admission: the default buckets must never refuse it.
RATE_LIMIT_OFF: dict[str, Any] = {"ratelimit": {"default": {
    "requests_per_second": 100000, "burst": 100000, "tokens_per_minute": 1.0e9, "token_burst": 1.0e9}}}


@dataclass(frozen=True)
class Settings:
    concurrency: tuple[int, ...]
    requests: int          # per unary cell and layout
    stream_requests: int   # per stream cell and layout
    rounds: int            # each cell is split into this many interleaved turns
    max_tokens: int
    cell_time_limit_s: float  # per cell and layout, over all its rounds
    warmup: int
    ready_timeout_s: float
    quick: bool
    layouts: tuple[str, ...] = LAYOUTS
    scale_with_concurrency: bool = False  # True unless --requests was given (or --quick)
    fixed_rounds: bool = False  # --rounds was given: every cell has that many
    model: str | None = None  # a transformers model directory served instead of the embedded model
    model_id: str = "tiny-lm"  # what the requests name
    sequential_requests: int = SEQUENTIAL_REQUESTS  # at least this many at concurrency 1 (scaled cells)
    regimes: tuple[str, ...] = ("cpu",)  # cpu: the built-in model here; device: the sim model
    capacity: bool = False  # the device regime's open-loop capacity curve
    capacity_step_s: float = 2.5  # seconds of arrivals per rate and layout
    device_model: str | None = None  # the device regime serves this model directory instead of sim (a GPU)
    only: tuple[str, ...] = ()  # --only: these serving rows alone (ONLY_PARTS), merged into --out

    def cell_requests(self, concurrency: int) -> int:
        """Requests in a unary cell: at 64 workers, 400 requests in 5 rounds would give each
        worker one or two calls a round — mostly ramp-up and drain, not steady load."""
        if not self.scale_with_concurrency:
            return self.requests
        if concurrency == 1:
            return max(self.requests, self.sequential_requests)
        return max(self.requests, REQUESTS_PER_WORKER * concurrency, CONCURRENT_REQUESTS)

    def cell_limit_s(self, concurrency: int, count: int) -> float:
        """Seconds a cell may take per layout: `cell_time_limit_s`, and where one client sends
        one request at a time, `SEQUENTIAL_BUDGET_S` per request if that is more, so a slow
        layout's rounds are not cut short (the rounds cut would be its slowest ones, and the
        ratio would hide them). Cells with many clients keep the limit: there it bounds
        the unbatched layouts, which are slow on purpose."""
        if concurrency == 1:
            return max(self.cell_time_limit_s, count * SEQUENTIAL_BUDGET_S)
        return self.cell_time_limit_s

    def cell_rounds(self, concurrency: int, count: int) -> int:
        """Rounds in a cell: `rounds`, and more, short ones, where one client sends one request
        at a time (`SEQUENTIAL_ROUND`), unless --rounds was given."""
        rounds = self.rounds
        if concurrency == 1 and not self.fixed_rounds:
            rounds = max(rounds, count // SEQUENTIAL_ROUND)
        return max(1, min(rounds, count))

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "concurrency": list(self.concurrency), "layouts": list(self.layouts),
                "regimes": list(self.regimes)}


def parse_args(argv: list[str] | None) -> tuple[Settings, Path, bool]:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few requests per cell (smoke test)")
    parser.add_argument("--concurrency", help="comma-separated worker counts (default 1,16,64,256; quick 1,16)")
    parser.add_argument("--layouts", help=f"comma-separated layouts of the cpu regime (default "
                                          f"{','.join(QUICK_LAYOUTS)}; any of {','.join(LAYOUTS)})")
    parser.add_argument("--regimes", help="comma-separated: cpu (the built-in model on this CPU), device (the sim "
                                          "model; bare, collapsed, layered) (default cpu,device; quick cpu)")
    parser.add_argument("--no-capacity", action="store_true",
                        help="skip the device regime's open-loop capacity curve (it runs unless --quick)")
    parser.add_argument("--device-model", metavar="DIR",
                        help="the device regime serves this transformers model directory (on the GPU where there "
                             "is one) instead of the sim model: tests/gpu/run.sh compares the two")
    parser.add_argument("--capacity-step", type=float, default=2.5,
                        help="seconds of Poisson arrivals per offered rate and layout (default 2.5; the lowest "
                             "rate, whose p99 is the reference, twice as long)")
    parser.add_argument("--requests", type=int,
                        help="unary requests per cell and layout (default: 1600, or 25 per worker where that is "
                             "more, so every round keeps all workers busy, and 1000 at concurrency 1; quick 12)")
    parser.add_argument("--stream-requests", type=int, help=f"stream requests per layout (default {STREAM_REQUESTS}; quick 6)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, help="interleaved turns per cell (default 5, and one per 40 "
                                                   "requests at concurrency 1; quick 2)")
    parser.add_argument("--cell-time-limit", type=float, default=20.0,
                        help="seconds per cell and layout before it stops sending (default 20; at concurrency 1, "
                             "40 ms per request where that is more)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results file (default {DEFAULT_OUT})")
    parser.add_argument("--keep-run-dir", action="store_true", help="keep server logs and sockets for inspection")
    parser.add_argument("--model", metavar="DIR", default=os.environ.get("SPINE_BENCH_MODEL") or None,
                        help="serve this transformers causal LM directory in every layout (default: "
                             "$SPINE_BENCH_MODEL, else the embedded tiny LM)")
    parser.add_argument("--model-id", help="the id --model is served under (default: the directory's name)")
    parser.add_argument("--only", help=f"comma-separated rows to measure alone, written into --out beside what it "
                                       f"holds: any of {', '.join(ONLY_PARTS)}")
    args = parser.parse_args(argv)
    only = tuple(part.strip() for part in args.only.split(",") if part.strip()) if args.only else ()
    if args.only is not None and (not only or set(only) - set(ONLY_PARTS)):
        parser.error(f"--only: expected some of {', '.join(ONLY_PARTS)}, got {args.only!r}")
    quick = bool(args.quick)
    spec = args.concurrency or ("1,16" if quick else "1,16,64,256")
    try:
        concurrency = tuple(sorted({int(part) for part in spec.split(",") if part.strip()}))
    except ValueError:
        parser.error(f"--concurrency: expected comma-separated integers like 1,16, got {spec!r}")
    if not concurrency or min(concurrency) < 1:
        parser.error(f"--concurrency: every value must be >= 1, got {spec!r}")
    # Not every layout by default: the batching variants (collapsed-unbatched, -middleware-
    # unbatched, layered-batched) answer questions the project has settled, and make bench
    # has the device regime and the capacity curve to fit in the same 15 minutes.
    layouts = tuple(part.strip() for part in args.layouts.split(",")) if args.layouts else QUICK_LAYOUTS
    unknown = [layout for layout in layouts if layout not in LAYOUTS]
    if unknown or not layouts:
        parser.error(f"--layouts: expected some of {', '.join(LAYOUTS)}, got {args.layouts!r}")
    regimes = tuple(part.strip() for part in (args.regimes or ("cpu" if quick else "cpu,device")).split(","))
    if not regimes or set(regimes) - {"cpu", "device"}:
        parser.error(f"--regimes: expected some of cpu, device, got {args.regimes!r}")
    requests = args.requests or (12 if quick else 400)
    stream_requests = args.stream_requests or (6 if quick else STREAM_REQUESTS)
    rounds = args.rounds or (2 if quick else 5)
    for name, value in (("--requests", requests), ("--stream-requests", stream_requests), ("--rounds", rounds),
                        ("--max-tokens", args.max_tokens)):
        if value < 1:
            parser.error(f"{name}: must be >= 1, got {value}")
    settings = Settings(concurrency=concurrency, requests=requests, stream_requests=stream_requests,
                        rounds=min(rounds, requests), max_tokens=args.max_tokens,
                        cell_time_limit_s=args.cell_time_limit, warmup=2 if quick else 6,
                        ready_timeout_s=120.0, quick=quick, layouts=layouts,
                        scale_with_concurrency=not quick and args.requests is None,
                        fixed_rounds=quick or args.rounds is not None, model=args.model,
                        model_id=(args.model_id or model_id_for(args.model)) if args.model else "tiny-lm",
                        regimes=regimes, capacity="device" in regimes and not quick and not args.no_capacity,
                        capacity_step_s=args.capacity_step, device_model=args.device_model, only=only)
    return settings, args.out, bool(args.keep_run_dir)


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
    merged.write_text(yaml.safe_dump(config))
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


def tear_down(sampler: RssSampler | None, endpoints: Mapping[str, Any], targets: dict[str, Target],
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


def measure(endpoints: Mapping[str, Any], sampler: RssSampler, settings: Settings,
            console: Console, *, stream: bool = True) -> list[dict[str, Any]]:
    """Every cell, its rounds interleaved across layouts; one run record per (cell, layout)."""
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
                    steps_before = sampler.targets[layout].model_steps()  # outside the CPU reading
                    sampler.measuring(layout, f"{layout}/{mode}/{concurrency}")
                    cpu_before = sampler.targets[layout].tree_cpu_s()
                    threads_before = sampler.targets[layout].tree_thread_cpu_s()
                    batch: Batch = run_batch(endpoints[layout], reqs, concurrency=concurrency,
                                             stream=mode == "stream", time_limit_s=round_limit)
                    cpu[layout] += sampler.targets[layout].tree_cpu_s() - cpu_before
                    by_thread[layout].update(thread_cpu_by_group(threads_before,
                                                                 sampler.targets[layout].tree_thread_cpu_s()))
                    sampler.measuring(layout, None)
                    steps_after = sampler.targets[layout].model_steps()
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
    sampler: RssSampler | None = None
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
        sampler = RssSampler({**targets, **{http_layout: targets[layout] for http_layout, layout in HTTP_LAYOUTS.items()
                                            if http_layout in endpoints}})
        sampler.start()
        with console.status("warming up"):
            warm_up(endpoints, settings)
        runs = measure(endpoints, sampler, settings, console)
        comparisons = add_ratios(runs)
        for run in runs:
            run["layout_peak_rss_mb"] = round(sampler.peak_by_layout.get(run["layout"], 0) / (1024 * 1024), 1)
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


def measure_part(part: str) -> dict[str, Any] | None:
    """One serving row of ONLY_PARTS (None: `system_prompt_hf` without transformers installed)."""
    if part == "serving":
        from bench.serving import measure_serving

        return measure_serving()
    if part == "system_prompt":
        from bench.serving import measure_system_prompt

        return measure_system_prompt()
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None
    from bench.serving import measure_system_prompt_hf

    return measure_system_prompt_hf()


def describe_system_prompt(name: str, sp: Mapping[str, Any]) -> str:
    line = (f"{name}: shared system prompt ({sp['requests']} requests, {sp['system_prompt_tokens']} tokens): KV "
            f"bytes {sp['kv_bytes_with_reuse']} with reuse vs {sp['kv_bytes_without_reuse']} without (ratio "
            f"{sp['kv_ratio']}); TTFT p50 {sp['ttft_p50_ms_with_reuse']} ms vs {sp['ttft_p50_ms_without_reuse']} ms")
    if "forwarded_tokens_with_reuse" in sp:
        line += (f"; positions forwarded {sp['forwarded_tokens_with_reuse']} vs "
                 f"{sp['forwarded_tokens_without_reuse']}")
    return line


def run_only(parts: tuple[str, ...], out: Path, console: Console) -> int:
    """`--only`: the named serving rows, written into `out` (its other keys kept)."""
    results: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    for part in parts:
        with console.status(f"{part} alone"):
            results[part] = measure_part(part)
        if part.startswith("system_prompt") and results[part] is not None:
            console.print(describe_system_prompt(part, results[part]))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    console.print(f"wrote {', '.join(parts)} into {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    settings, out, keep = parse_args(argv)
    console = Console() if sys.stdout.isatty() else Console(width=150)  # logs and pipes get the whole table
    if settings.only:
        return run_only(settings.only, out, console)
    # SIGTERM (e.g. from a test timeout) unwinds through the finally below, which stops the servers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    machine = machine_info()
    began = time.perf_counter()
    cpu = Regime([], [], [])
    if "cpu" in settings.regimes:
        console.print("[bold]cpu regime[/bold]: the built-in model on this CPU")
        cpu = run_regime(settings, console, keep)
    device: Regime | None = None
    if "device" in settings.regimes:
        from bench.device_regime import device_settings, profile_name

        console.print(f"[bold]device regime[/bold]: {profile_name(settings)}, steps off the CPU")
        machine["loadavg_device_start"] = [round(x, 2) for x in os.getloadavg()]
        device = run_regime(device_settings(settings), console, keep, extra=DEVICE_OVERLAY, http=False,
                            capacity=settings.capacity)
        device.profile = profile_name(settings)
    runs, comparisons, left = cpu.runs, cpu.comparisons, cpu.left + (device.left if device else [])
    serving: dict[str, Any] | None = None
    if not settings.quick and not settings.model and "cpu" in settings.regimes:  # the embedded model's
        from bench.serving import measure_serving

        with console.status("priority classes and the KV pool"):
            serving = measure_serving()
    system_prompt: dict[str, Any] | None = None
    system_prompt_hf: dict[str, Any] | None = None
    if not settings.quick and not settings.model and "cpu" in settings.regimes:  # prefix reuse, both backends
        with console.status("100 requests sharing one system prompt, with and without reuse"):
            system_prompt = measure_part("system_prompt")
        with console.status("the same on a tiny llama (transformers backend)"):
            system_prompt_hf = measure_part("system_prompt_hf")
    # SmolLM2-135M-Instruct, bare vs collapsed vs layered: the middleware next to a real model's cost
    real_model = None if settings.quick or settings.model else measure_real_model(say=console.print)
    machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    results = {"runs": runs, "serving": serving, "system_prompt": system_prompt,
               "system_prompt_hf": system_prompt_hf, "real_model": real_model,
               "layered_vs_collapsed": comparisons, "http_vs_grpc": http_vs_grpc(runs, HTTP_LAYOUTS),
               "batched_vs_unbatched": batching_gain(runs),
               "batched_vs_middleware_unbatched": batching_gain(runs, "collapsed-middleware-unbatched"),
               "layered_batched_vs_layered": batching_gain(runs, "layered", batched_layout="layered-batched"),
               "machine": machine, "started_at": started_at, **device_results(device),
               "duration_s": round(time.perf_counter() - began, 1), "settings": settings.as_dict(),
               "processes_left_running": left}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    from bench.plot import plot_scaling

    plot = plot_scaling(results, out.with_suffix(".png")) if runs else None
    if runs:
        print_tables(results, console)
    if device is not None:
        print_device(results, console, out)
    if serving is not None:
        console.print(
            f"priority classes ({serving['kv_slots']} KV slots, {serving['requests_per_round']} requests a round): "
            f"p50 latency class {serving['latency_class_p50_ms']} ms vs throughput class "
            f"{serving['throughput_class_p50_ms']} ms (single class {serving['single_class_p50_ms']} ms); "
            f"throughput {serving['throughput_change_pct']:+.1f}% vs single class; KV: {serving['kv']['formula']}")
    for name, row in (("system_prompt", system_prompt), ("system_prompt_hf", system_prompt_hf)):
        if row is not None:
            console.print(describe_system_prompt(name, row))
    if real_model is not None:
        console.print(describe_real_model(real_model))
    console.print(f"wrote {out}{f' and {plot}' if plot else ''} in {results['duration_s']} s")
    return 1 if left else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except TargetFailed as failure:
        print(f"bench: a server did not start: {failure}", file=sys.stderr)
        sys.exit(2)
    except ConfigError as error:
        print(f"bench: {error}", file=sys.stderr)
        sys.exit(2)
