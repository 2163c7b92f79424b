"""Process-wide torch settings, applied once at start by every spine process."""

from __future__ import annotations

import os

import torch


def configure_threads() -> int:
    """One intra-op thread per process unless SPINE_TORCH_THREADS says otherwise.

    Why: the layered layout runs eight processes on a few cores; torch's default of one
    thread per core in each of them oversubscribes the CPU and makes every layout slower
    in a way that says nothing about the layouts themselves.
    """
    threads = int(os.environ.get("SPINE_TORCH_THREADS", "1"))
    torch.set_num_threads(threads)
    return threads
