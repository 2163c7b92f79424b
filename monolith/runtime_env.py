"""Process-wide torch and thread settings, applied once at start by every spine process."""

from __future__ import annotations

import gc
import os
import sys

from services.inference.cpu_placement import PlacementError, enable_from_env

_threads: int | None = None  # what `configure_threads` asked for, for a torch imported later


def configure_threads() -> int:
    """One intra-op thread per process unless SPINE_TORCH_THREADS says otherwise, and a
    process that serves a model on a CPU of its own unless SPINE_CPU says otherwise
    (`services.inference.cpu_placement`: why, and what it measured).

    Why one intra-op thread: the layered layout runs eight processes on a few cores; torch's
    default of one thread per core in each of them oversubscribes the CPU and makes every
    layout slower in a way that says nothing about the layouts themselves.
    """
    threads = int(os.environ.get("SPINE_TORCH_THREADS", "1"))
    global _threads
    _threads = threads
    if "torch" in sys.modules:
        apply_torch_threads()
    else:
        # Torch is imported later, or never: a process whose components keep no tensors
        # (auth, the router, logs, the layered gateway) skips its import, most of its start
        # (`monolith.device_on_use`). Torch sizes its pool from this when it is imported;
        # the device context applies the setting itself when it is made.
        os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        enable_from_env(count=threads)
    except PlacementError as error:  # before anything starts: one line, as for a bad config
        print(f"spine: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    return threads


def apply_torch_threads() -> None:
    """Give torch the thread count `configure_threads` asked for (nothing if it was not
    called: a library user's process keeps torch's own setting)."""
    if _threads is not None:
        import torch

        torch.set_num_threads(_threads)


def freeze_startup_heap() -> int:
    """Take what the process made while starting out of the cyclic collector's sight (after
    one collection of the garbage it left), once it is about to serve; returns how many
    objects were frozen.

    Why: a started spine process tracks hundreds of thousands of long-lived objects (torch's,
    grpc's and protobuf's modules, the config, the tables' wrappers). Every full (gen-2)
    collection walked them all with the GIL held, every few thousand requests: a pause of
    tens of milliseconds for every request in flight and for the model's decode loop alike. Frozen (`gc.freeze`), they are never walked again; a full
    collection then scans only what was made since. Objects made later are collected as
    before, cycles included.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
