"""`python -m bench.warm_path`: the spine's own work per request, warm, the model taken out.

Why: on this kind of host a throughput ratio from one load run moves between runs of the
same two builds by more than most changes are worth, so a change to the request path that
saves a few µs cannot be seen there. This measures only what the spine adds — the gateway,
admission, the answer's trailers, the hand-over, and the completions (cache store, logs,
metrics) written a window at a time as the folder does under load — in one process, in a
warm loop, with the inference client answering a canned response at once. It moves far
less between runs (on a quiet host). Under load the same work costs several times more (each
slice of it resumes on caches the model's step has just used: compare `make bench`'s CPU
split by thread, the spine's handler threads against bare's), so read it as the
size of the work, not as its cost under load.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.cold_path import _Context
from bench.load import prompts, requests_for
from bench.settings import DEV_KEY, RATE_LIMIT_OFF
from monolith.runtime_env import configure_threads
from runtime.config.file import load_config, placements_for
from runtime.stack import Stack
from services.inference.api import INFERENCE, Generated, Inference
from services.pipeline.interface import NO_OPTIONS, CallOptions
from wire.v1 import generation_pb2


class CannedInference:
    """The inference component with `generate` answering at once (everything else passes through)."""

    def __init__(self, inference: Inference) -> None:
        self._inference = inference

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inference, name)

    def generate(self, request: generation_pb2.GenerateRequest, options: CallOptions = NO_OPTIONS) -> Generated:
        return Generated(generation_pb2.GenerateResponse(text="canned answer", token_ids=list(range(8)),
                                                         model=request.model, finish_reason="length",
                                                         prompt_tokens=24, completion_tokens=8),
                         (("x-spine-load", f"{request.model}=0.1"),))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.warm_path", description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=400, help="measured windows")
    parser.add_argument("--window", type=int, default=16, help="requests per completions window")
    args = parser.parse_args(argv)
    if args.windows < 1 or args.window < 1:
        parser.error("--windows and --window must be at least 1")
    configure_threads()
    config = load_config(overrides=RATE_LIMIT_OFF)
    run_dir = Path(tempfile.mkdtemp(prefix="spine-warm-"))
    stack = Stack(config, placements_for("collapsed", config), run_dir=run_dir).start()
    try:
        gateway, completions = stack.gateway, stack.completions
        assert completions is not None  # the completions steps are local: handed over after the answer
        stack.components.placed.swap("inference", CannedInference(stack.component(INFERENCE)))
        completions._busy = lambda: True  # the folder never fires: the windows are written below
        completions.interval_s = 3600.0
        metadata = (("authorization", f"Bearer {DEV_KEY}"),)
        requests = iter(requests_for(prompts("warm-path", (args.windows + 50) * args.window), 8))

        def window() -> tuple[float, float]:
            started = time.perf_counter()
            for _ in range(args.window):
                gateway.Generate(next(requests), _Context(metadata))
            answered = time.perf_counter()
            completions.drain()
            return (answered - started) / args.window, (time.perf_counter() - answered) / args.window

        for _ in range(50):
            window()
        measured = [window() for _ in range(args.windows)]
    finally:
        stack.stop()
    handler = statistics.median(m[0] for m in measured) * 1e6
    writes = statistics.median(m[1] for m in measured) * 1e6
    print(f"per request, warm, model taken out: request path {handler:.1f} µs, completions {writes:.1f} µs "
          f"(windows of {args.window}), total {handler + writes:.1f} µs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
