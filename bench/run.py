"""`make bench`: bare model service vs collapsed spine vs layered stack, in two regimes, in one run.

    python -m bench.run [--quick] [--concurrency 1,16,64] [--requests N] [--out bench/results.json]
                        [--regimes cpu,device] [--no-capacity]
                        [--model DIR [--model-id ID]]      (or SPINE_BENCH_MODEL=DIR make bench)
    python -m bench.run --only system_prompt,system_prompt_hf   (those rows alone, into --out)
    python -m bench.run --only legacy   (LiteLLM vs the spine over an upstream vs the model alone)

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
(`bench.serving.measure_system_prompt_hf`); `legacy` the same bare model server behind LiteLLM
proxy, behind the spine (an `upstream:` model) and alone, driven by k6 (`bench.legacy`).
`--only` runs the named rows alone (seconds each; `legacy` a few minutes) and writes them
into --out, keeping what else the file holds.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.console import Console

from bench.device_regime import DEVICE_OVERLAY, Regime, device_results, print_device
from bench.real_model import describe as describe_real_model
from bench.real_model import measure_real_model
from bench.regime import run_regime
from bench.report import batching_gain, http_vs_grpc, machine_info, print_tables
from bench.settings import HTTP_LAYOUTS, ROWS, parse_args
from bench.targets import (
    TargetFailed,
)
from services.common import ConfigError


def measure_part(part: str) -> dict[str, Any] | None:
    """One serving row of ONLY_PARTS (None: `system_prompt_hf` without transformers installed)."""
    if part in ROWS:
        row: dict[str, Any] = importlib.import_module(ROWS[part]).measure()
        return row
    if part == "serving":
        from bench.serving import measure_serving

        return measure_serving()
    if part == "system_prompt":
        from bench.serving import measure_system_prompt

        return measure_system_prompt()
    if part == "legacy":
        from bench.legacy import measure_legacy

        return measure_legacy()
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None
    from bench.serving import measure_system_prompt_hf

    return measure_system_prompt_hf()


def describe_row(part: str, row: Mapping[str, Any]) -> str:
    """One line for a row of ROWS."""
    return str(importlib.import_module(ROWS[part]).describe(row))


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
        if part in ROWS and results[part] is not None:
            console.print(describe_row(part, results[part]))
        if part == "legacy" and results[part] is not None:
            from bench.legacy import describe as describe_legacy

            console.print(describe_legacy(results[part]))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    console.print(f"wrote {', '.join(parts)} into {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from monolith.runtime_env import prefer_huge_pages

    prefer_huge_pages()  # the serving rows run models in this process; the layouts start their own
    settings, out, keep = parse_args(argv, __doc__)
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
    # The same bare model server behind LiteLLM, behind the spine (an upstream), and alone (k6)
    legacy: dict[str, Any] | None = None
    if not settings.quick and not settings.model and "cpu" in settings.regimes:
        with console.status("the legacy row: LiteLLM, the spine over an upstream, the model alone (k6)"):
            legacy = measure_part("legacy")
    rows: dict[str, Any] = {}
    if not settings.quick and not settings.model:  # each a module's measure() (ROWS)
        for part in ROWS:
            with console.status(f"{part} ({ROWS[part]})"):
                rows[part] = measure_part(part)
    machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    results = {**rows, "runs": runs, "serving": serving, "system_prompt": system_prompt,
               "system_prompt_hf": system_prompt_hf, "real_model": real_model, "legacy": legacy,
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
    if legacy is not None:
        from bench.legacy import describe as describe_legacy

        console.print(describe_legacy(legacy))
    for part, row in rows.items():
        console.print(describe_row(part, row))
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
