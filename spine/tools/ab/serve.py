"""One layout in its own process tree, for `spine ab`.

    python -m spine.tools.ab.serve --layout layered --config run/config.yaml --run-dir run/layered

Like `spine up`, plus what the A/B runner measures from inside: spans per middleware
(summed in memory, no exporter on the request path) and the device's peak memory. It
prints one JSON `ready` line, serves until SIGTERM, then writes `ab-serve.json` in the
run directory; a `reset` line on stdin drops the spans so far (the runner sends one after
the warm-up). Running each layout in a process of its own is what makes CPU seconds and
memory attributable to a layout (psutil on the process tree).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.observability.tracing import SpanTimes

RESULT_FILE = "ab-serve.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spine.tools.ab.serve", description=__doc__)
    parser.add_argument("--layout", required=True, choices=("layered", "collapsed", "mixed"))
    parser.add_argument("--config", required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--trace-ratio", type=float, default=1.0, help="share of requests traced (0 = none)")
    args = parser.parse_args(argv)

    from runtime.processes.parent import die_with_parent

    die_with_parent()
    from monolith.runtime_env import configure_threads, prefer_huge_pages

    prefer_huge_pages()  # before anything imports torch
    from runtime.config.file import load_config, placements_for
    from runtime.observability.tracing import SpanTimes, Tracing, install
    from runtime.processes.signals import Termination
    from runtime.stack import Stack

    termination = Termination()
    configure_threads()
    config = load_config(args.config)
    times = SpanTimes()
    tracing = Tracing(sample_ratio=args.trace_ratio, processors=[times]) if args.trace_ratio > 0 else None
    install(tracing)
    run_dir = Path(args.run_dir)
    # No hooks of our own: a Stack adds the installed tracing's hook itself (passing it here
    # too made two spans of every call, and every span time in `spine ab` twice the truth).
    try:
        stack = Stack(config, placements_for(args.layout, config), run_dir=run_dir).start()
    except Exception as error:
        print(json.dumps({"event": "failed", "error": str(error)}), flush=True)
        return 1
    children = stack.supervisor.pids() if stack.supervisor is not None else {}
    print(json.dumps({"event": "ready", "address": stack.address, "pid": os.getpid(), "children": children}),
          flush=True)
    threading.Thread(target=_answer_resets, args=(times,), name="ab-reset", daemon=True).start()
    try:
        termination.wait()
    finally:
        stack.stop()
        result: dict[str, Any] = {"spans": {}, "device_peak_bytes": _device_peak()}
        if tracing is not None:
            tracing.flush()
            for spans in times.snapshot().values():  # one layout per process: merge the labels
                for name, stat in spans.items():
                    merged = result["spans"].setdefault(name, {"count": 0, "total_s": 0.0})
                    merged["count"] += stat["count"]
                    merged["total_s"] += stat["total_s"]
        (run_dir / RESULT_FILE).write_text(json.dumps(result))
    return 0


def _answer_resets(times: SpanTimes) -> None:
    """The runner's lines on stdin: `reset` forgets the spans measured so far (the warm-up's:
    a first call's imports and allocations would count in every middleware's mean),
    answered with a `reset` event line once done."""
    for line in sys.stdin:
        if line.strip() == "reset":
            times.reset()
            print(json.dumps({"event": "reset"}), flush=True)


def _device_peak() -> int | None:
    """Peak bytes the torch allocator held on CUDA in this process (None on CPU)."""
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return int(torch.cuda.max_memory_allocated())
    except Exception:
        pass
    return None


if __name__ == "__main__":
    sys.exit(main())
