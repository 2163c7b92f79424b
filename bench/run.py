"""`make bench`: bare model service vs collapsed spine vs layered stack, in two regimes, in one run.

    python -m bench.run [--quick] [--concurrency 1,16,64] [--requests N] [--out bench/results.json]
                        [--regimes cpu,device] [--no-capacity]
                        [--model DIR [--model-id ID]]      (or SPINE_BENCH_MODEL=DIR make bench)

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
with and without the prefix cache (`bench.serving.measure_system_prompt`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

from rich.console import Console

from bench.device_regime import DEVICE_OVERLAY, Regime, device_results, print_device
from bench.real_model import describe as describe_real_model
from bench.real_model import measure_real_model
from bench.regime import run_regime
from bench.report import batching_gain, http_vs_grpc, machine_info, print_tables
from bench.settings import HTTP_LAYOUTS, parse_args
from bench.targets import (
    TargetFailed,
)
from services.common import ConfigError


def main(argv: list[str] | None = None) -> int:
    settings, out, keep = parse_args(argv, __doc__)
    console = Console() if sys.stdout.isatty() else Console(width=150)  # logs and pipes get the whole table
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
    if not settings.quick and not settings.model and "cpu" in settings.regimes:  # the embedded model's prefix cache
        from bench.serving import measure_system_prompt

        with console.status("100 requests sharing one system prompt, with and without reuse"):
            system_prompt = measure_system_prompt()
    # SmolLM2-135M-Instruct, bare vs collapsed vs layered: the middleware next to a real model's cost
    real_model = None if settings.quick or settings.model else measure_real_model(say=console.print)
    machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    results = {"runs": runs, "serving": serving, "system_prompt": system_prompt, "real_model": real_model,
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
    if system_prompt is not None:
        sp = system_prompt
        console.print(
            f"shared system prompt ({sp['requests']} requests, {sp['system_prompt_tokens']} tokens): KV bytes "
            f"{sp['kv_bytes_with_reuse']} with reuse vs {sp['kv_bytes_without_reuse']} without "
            f"(ratio {sp['kv_ratio']}); TTFT p50 {sp['ttft_p50_ms_with_reuse']} ms vs "
            f"{sp['ttft_p50_ms_without_reuse']} ms")
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
