"""Process-wide torch and thread settings, applied once at start by every spine process."""

from __future__ import annotations

import os
import sys

import torch

from services.cpu_placement import PlacementError, enable_from_env


def configure_threads() -> int:
    """One intra-op thread per process unless SPINE_TORCH_THREADS says otherwise, and a
    process that serves a model on a CPU of its own unless SPINE_CPU says otherwise
    (`services.cpu_placement`: why, and what it measured).

    Why one intra-op thread: the layered layout runs eight processes on a few cores; torch's
    default of one thread per core in each of them oversubscribes the CPU and makes every
    layout slower in a way that says nothing about the layouts themselves.
    """
    threads = int(os.environ.get("SPINE_TORCH_THREADS", "1"))
    torch.set_num_threads(threads)
    try:
        enable_from_env(count=threads)
    except PlacementError as error:  # before anything starts: one line, as for a bad config
        print(f"spine: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    return threads
