"""Process-wide torch and thread settings, applied once at start by every spine process.

Every entry point of a process that serves a model calls them itself, first thing (the
layered child `python -m runtime.process`, `spine up`, `spine ab`'s servers, the bench):
a setting made by importing some package would hold for one entry point and not another,
and the layouts would then differ in exactly what the setting exists to hold equal.
"""

from __future__ import annotations

import gc
import logging
import os
import sys

from services.inference.cpu_placement import PlacementError, enable_from_env

_threads: int | None = None  # what `configure_threads` asked for, for a torch imported later
HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"


def prefer_huge_pages() -> bool:
    """Ask torch (not imported yet) to put its large CPU buffers — model weights, the KV
    cache, the device tables — on transparent huge pages (2 MiB, `madvise`); returns whether
    the setting can still take effect (False once torch is imported: it reads the variable
    once, at its first allocation).

    Why: with 4 KiB pages the model's step time varied widely from one process to the next
    on the same code (for the same requests, depending on where its weights landed), which is
    slower on average and made every side-by-side ratio a draw; on huge pages one process
    after another kept nearly the same step time. An operator's own `THP_MEM_ALLOC_ENABLE`
    wins (`0` turns it off); the kernel must allow `madvise` huge pages (the default on
    Linux). Child processes inherit it.
    """
    os.environ.setdefault(HUGE_PAGES_ENV, "1")
    if "torch" in sys.modules:
        logging.getLogger("spine").warning("torch was imported before %s was set: this process's tensors are on "
                                           "small pages", HUGE_PAGES_ENV)
        return False
    return True


def configure_threads() -> int:
    """One intra-op thread per process unless SPINE_TORCH_THREADS says otherwise, and a
    process that serves a model on a CPU of its own unless SPINE_CPU says otherwise
    (`services.inference.cpu_placement`: why, and what it measured).

    Why one intra-op thread: the layered layout runs eight processes on a few cores; torch's
    default of one thread per core in each of them oversubscribes the CPU and makes every
    layout slower in a way that says nothing about the layouts themselves.

    Also asks for huge pages (`prefer_huge_pages`), for an entry point that did not already.
    """
    os.environ.setdefault(HUGE_PAGES_ENV, "1")
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
