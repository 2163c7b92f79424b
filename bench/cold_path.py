"""`python -m bench.cold_path`: what a lone request costs the spine in-process, phase by phase.

At concurrency 1 a request arrives on a core whose caches the idle time has emptied: the
same admission costs several times what it costs in a warm loop, and the cost
follows the distinct code and data a request touches more than its bytecode count. This
measures that case without gRPC or a second process, so a change to the request path can
be judged in a minute, well inside the run-to-run noise of `make bench`'s c=1 cell:

- one collapsed `Stack` in this process; requests alternate between the spine's
  `Gateway.Generate` and the inference servicer alone (the bare baseline), each after the
  model has run, greedy with distinct prompts (no cache hits);
- per phase of the gateway's request (begin, admission, model call, answer trailers,
  finish): the median wall time; and the median gateway time minus the servicer's.

`--inline` writes each request's completions (cache store, logs, metrics) right after it,
outside the timing, instead of on the spine's folder thread.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.load import prompts, requests_for
from bench.settings import DEV_KEY, RATE_LIMIT_OFF
from monolith.runtime_env import configure_threads
from runtime.config.file import load_config, placements_for
from runtime.stack import Stack
from services.pipeline.local_context import LocalContext

PHASES = (("_begin", "begin"), ("_generate", "model call"), ("_answer_trailing", "answer trailers"),
          ("_finish", "finish"))


class _Context:
    """The little of a server context the gateway reads for a unary call."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def time_remaining(self) -> float:
        return 30.0

    def set_trailing_metadata(self, trailing: Any) -> None:
        pass

    def abort(self, code: Any, details: str) -> None:
        raise RuntimeError(f"{code}: {details}")

    def add_callback(self, callback: Callable[[], None]) -> bool:
        return True

    def is_active(self) -> bool:
        return True


def _timed(owner: Any, name: str, into: list[float]) -> None:
    original = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - started)
    setattr(owner, name, wrapper)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cold_path", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400, help="measured requests per side")
    parser.add_argument("--inline", action="store_true", help="write completions outside the timing")
    args = parser.parse_args(argv)
    configure_threads()
    config = load_config(overrides=RATE_LIMIT_OFF)
    run_dir = Path(tempfile.mkdtemp(prefix="spine-cold-"))
    stack = Stack(config, placements_for("collapsed", config), run_dir=run_dir).start()
    try:
        gateway, servicer = stack.gateway, stack.local_servicers["inference"]
        assert stack.admission is not None  # every admission step is local: admitted in batches
        completions = stack.completions
        if args.inline and completions is not None:
            completions._busy = lambda: True  # the folder never fires: written below, untimed
            completions.interval_s = 3600.0
        metadata = (("authorization", f"Bearer {DEV_KEY}"),)
        requests = iter(requests_for(prompts("cold-path", 2 * args.requests + 100), 8))
        for _ in range(25):  # warm up both sides
            gateway.Generate(next(requests), _Context(metadata))
            servicer.Generate(next(requests), LocalContext((), time.monotonic() + 30, None))
        phases: dict[str, list[float]] = defaultdict(list)
        for attribute, label in PHASES:
            _timed(gateway, attribute, phases[label])
        _timed(stack.admission, "admit", phases["admission"])
        spine: list[float] = []
        bare: list[float] = []
        for _ in range(args.requests):
            started = time.perf_counter()
            gateway.Generate(next(requests), _Context(metadata))
            spine.append(time.perf_counter() - started)
            if args.inline and completions is not None:
                completions.drain()
            time.sleep(0.0005)
            started = time.perf_counter()
            servicer.Generate(next(requests), LocalContext((), time.monotonic() + 30, None))
            bare.append(time.perf_counter() - started)
            time.sleep(0.0005)
    finally:
        stack.stop()

    def us(values: list[float]) -> int:
        return round(statistics.median(values) * 1e6)

    for label in ("begin", "admission", "model call", "answer trailers", "finish"):
        print(f"{label:16s} p50 {us(phases[label]):6d} µs")
    print(f"gateway p50 {us(spine)} µs, inference servicer alone p50 {us(bare)} µs: "
          f"{us(spine) - us(bare)} µs more ({statistics.median(spine) / statistics.median(bare):.3f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
