"""`make bench`'s settings: the cells (modes × concurrencies), their sizes and time budgets,
the layouts in each, and the command line that sets them (`parse_args`)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.targets import (
    LAYOUTS,
    QUICK_LAYOUTS,
)
from runtime.config.served_model import model_id_for

DEV_KEY = "spine-dev-key-0000"
DEFAULT_OUT = Path(__file__).with_name("results.json")
REQUESTS_PER_WORKER = 25  # per unary cell, so each of the rounds keeps every worker busy
# And at least this many in a cell with many clients. At 16 clients 25 a worker made 400
# requests, rounds of 80: a quarter of a second of load per layout and turn, where a slow
# spell of the host lasts seconds. One `make bench` read the spine at 0.75 of bare at c=16
# (its rounds 0.65-0.81), the run before 0.90, focused runs of 3600 requests 0.80-0.93.
CONCURRENT_REQUESTS = 1600
# One client sends one request at a time: its cell gets at least this many requests, cut into
# rounds of about `SEQUENTIAL_ROUND` (a third of a second per layout). A slow spell of the
# host lasts seconds; with five long rounds it landed on one layout more than another, and
# two identical spines in one run differed by 9% (1.26 vs 1.16 ×bare at c=1); in rounds of
# 40 they agree within 1% (1.09/1.08, 1.09/1.08 in two runs).
SEQUENTIAL_REQUESTS = 1000
# Streamed requests per layout (one client): time to first token is a few ms with a long tail
# (p99 three times p50), and its median from 200 moved with the host: one run read the spine's
# TTFT at 1.28x bare where two focused runs of 1000 in the same hour read 1.127 and 1.122.
STREAM_REQUESTS = 600
SEQUENTIAL_ROUND = 40
SEQUENTIAL_BUDGET_S = 0.04  # per request of a cell: the layered layout takes ~20 ms at concurrency 1
# Unmeasured requests at the start of every turn. Taking turns evens out the host's slow
# spells but adds a cost no server has in steady state: each turn starts on caches the five
# other layouts' turns have just used, and the more memory a layout touches per request, the
# more its first requests pay (with rounds of 40 and six layouts, collapsed/bare at c=1 read
# 1.12-1.14 where three layouts read 1.08-1.10).
TURN_WARMUP = 3
# The HTTP API (`runtime.http`), measured beside the gRPC path of the same server process:
# each pseudo-layout calls its layout's HTTP listener (a unix socket, as the gRPC one is) with
# the same prompts. Only in the cells its targets are stated for (p50 at c=1, throughput at
# c=64) and the stream cell (TTFT), to keep `make bench` within its time.
HTTP_LAYOUTS: dict[str, str] = {"collapsed-http": "collapsed", "layered-http": "layered"}
HTTP_CONCURRENCY = (1, 64)


def in_cell(layout: str, mode: str, concurrency: int) -> bool:
    """Whether `layout` takes part in a cell (the HTTP pseudo-layouts only in theirs)."""
    return layout not in HTTP_LAYOUTS or mode == "stream" or concurrency in HTTP_CONCURRENCY


# The bench measures overhead, not admission: the default buckets must never refuse it.
RATE_LIMIT_OFF: dict[str, Any] = {"ratelimit": {"default": {
    "requests_per_second": 100000, "burst": 100000, "tokens_per_minute": 1.0e9, "token_burst": 1.0e9}}}


# Rows of a module of their own, each with `measure()` and `describe(row)`: in a full run, and
# each alone with `--only`.
ROWS = {"fair_share": "bench.fair_share", "genai_telemetry": "bench.genai_cost", "vllm": "bench.vllm_row"}
# The serving rows `--only` may run alone (`bench.serving`, and ROWS).
ONLY_PARTS = ("serving", "system_prompt", "system_prompt_hf", "legacy", *ROWS)


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


def parse_args(argv: list[str] | None, description: str | None = None) -> tuple[Settings, Path, bool]:
    """`python -m bench.run`'s command line (`description`: its help text, bench.run's docstring)."""
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=description,
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
