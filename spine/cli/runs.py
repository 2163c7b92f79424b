"""`spine ab` and `spine demo`: the layouts side by side — one workload through several of
them with a report, and the migration demo (`make run`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from runtime.config.file import LAYOUTS, load_config
from services.common import ConfigError
from spine.cli.up import served_model


def add_run_parsers(sub: Any) -> None:
    ab = sub.add_parser("ab", help="one workload through several layouts, interleaved, with a report")
    ab.add_argument("--layouts", default="layered,collapsed",
                    help="comma-separated layouts to start (layered, collapsed, mixed); default: %(default)s")
    ab.add_argument("--target", action="append", metavar="NAME=HOST:PORT",
                    help="also compare a Gateway already running there (repeatable)")
    ab.add_argument("--count", type=int, default=200, help="requests (each goes to every layout)")
    ab.add_argument("--concurrency", type=int, default=4, help="closed-loop workers")
    ab.add_argument("--rate", type=float, default=0.0, help="open loop: Poisson arrivals per second")
    ab.add_argument("--open-loop", action="store_true", help="open loop at the trace's own arrival times")
    ab.add_argument("--time-limit", type=float, default=120.0, help="no request starts after this many seconds")
    ab.add_argument("--timeout", type=float, default=10.0, help="per-request deadline in seconds")
    ab.add_argument("--warmup", type=int, default=4, help="unmeasured requests per layout first")
    ab.add_argument("--seed", type=int, default=7)
    ab.add_argument("--prompt-words", default="2:24", help="MIN:MAX prompt length in words (log-uniform)")
    ab.add_argument("--max-tokens", default="4:16", help="MIN:MAX tokens to generate (log-uniform)")
    ab.add_argument("--tenants", help="tenant mix, e.g. dev=3,other=1 (default: every dev key alike)")
    ab.add_argument("--cacheable-share", type=float, default=0.5)
    ab.add_argument("--repeat-share", type=float, default=0.3)
    ab.add_argument("--stream-share", type=float, default=0.0)
    ab.add_argument("--burst-every", type=float, default=0.0, help="open loop: a burst every this many seconds")
    ab.add_argument("--burst-size", type=int, default=0, help="open loop: requests arriving at once per burst")
    ab.add_argument("--trace", help="replay this JSONL trace instead of a synthetic workload")
    ab.add_argument("--record", help="write the workload to this JSONL trace (then run it)")
    ab.add_argument("--trace-ratio", type=float, default=1.0, help="share of requests with spans (0 = none)")
    ab.add_argument("--out", default="ab-report", help="directory for ab.json, report.md and the plots")
    ab.add_argument("--no-plots", action="store_true")
    ab.set_defaults(handler=cmd_ab)

    demo = sub.add_parser("demo", help="the main job: both layouts side by side (`make run`)")
    demo.add_argument("--model", metavar="DIR", help="run it on this transformers model directory (`make run "
                                                   "MODEL=DIR`) instead of the built-in tiny LM")
    demo.add_argument("--model-id", help="the id --model is served under (default: the directory's name)")
    demo.set_defaults(handler=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from runtime.processes.signals import sigterm_as_interrupt
    from spine.tools.demo.migration import run_migration_demo

    config = load_config(args.config, served_model(args))  # --model DIR: both sides serve it
    pace: dict[str, Any] = {}
    if args.model:
        from spine.tools.demo.migration import for_real_model

        config, pace = for_real_model(config)
    try:
        with sigterm_as_interrupt():
            return run_migration_demo(config, **pace)
    except KeyboardInterrupt:
        print("interrupted: both layouts, the controller and the traffic were stopped", file=sys.stderr)
        return 130


def cmd_ab(args: argparse.Namespace) -> int:
    from spine.tools.ab.command import run_command
    from spine.tools.ab.interleave import RunOptions
    from spine.tools.workload.generator import SyntheticSpec
    from spine.tools.workload.recorded import TraceError

    config = load_config(args.config)
    layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    bad = sorted(set(layouts) - set(LAYOUTS))
    if bad:
        raise ConfigError(f"--layouts: unknown layout(s) {bad}; choose from {', '.join(LAYOUTS)}")
    targets = {}
    for target in args.target or []:
        name, sep, address = target.partition("=")
        if not sep or not name or not address:
            raise ConfigError(f"--target: expected NAME=HOST:PORT, got {target!r}")
        targets[name] = address
    if not layouts and not targets:
        raise ConfigError("nothing to compare: give --layouts and/or --target")
    try:
        spec = SyntheticSpec(
            count=args.count, seed=args.seed, prompt_words=_range(args.prompt_words, "--prompt-words"),
            max_tokens=_range(args.max_tokens, "--max-tokens"), tenants=_weights(args.tenants),
            cacheable_share=args.cacheable_share, repeat_share=args.repeat_share, stream_share=args.stream_share,
            rate=args.rate or 20.0, burst_every_s=args.burst_every, burst_size=args.burst_size)
        options = RunOptions(mode="open" if args.rate or args.open_loop else "closed", concurrency=args.concurrency,
                             time_limit_s=args.time_limit, timeout_s=args.timeout, warmup=args.warmup)
    except ValueError as error:
        raise ConfigError(str(error)) from error
    try:
        return run_command(config, layouts=layouts, out_dir=Path(args.out), spec=spec,
                           trace=Path(args.trace) if args.trace else None,
                           record=Path(args.record) if args.record else None, targets=targets, options=options,
                           trace_ratio=args.trace_ratio, plots=not args.no_plots)
    except TraceError as error:
        print(f"trace error: {error}", file=sys.stderr)
        return 2


def _range(text: str, flag: str) -> tuple[int, int]:
    low, sep, high = text.partition(":")
    try:
        return (int(low), int(high)) if sep else (int(low), int(low))
    except ValueError:
        raise ConfigError(f"{flag}: expected MIN:MAX (integers), got {text!r}") from None


def _weights(text: str | None) -> dict[str, float]:
    weights: dict[str, float] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, sep, weight = part.partition("=")
        try:
            weights[name.strip()] = float(weight) if sep else 1.0
        except ValueError:
            raise ConfigError(f"--tenants: expected TENANT=WEIGHT, got {part!r}") from None
    return weights
