"""The cyclic garbage collector on a thread of its own, for a process whose code crashes
CPython before 3.12 when a collection starts in the wrong place.

CPython 3.11 and earlier run the cyclic GC wherever an allocation crosses its threshold,
including the allocation of a node inside `ContextVar.set` (`_PyHamt_Assoc`). If that
collection frees a coroutine whose `finally` sets or resets a context variable of the same
context (or a weakref callback does), the inner set frees the context's old mapping while the
outer one is still walking it: a use-after-free, and the process dies with SIGSEGV in
`PyContextVar_Set` (python/cpython#148891; 3.12 moved collections to the eval loop's
checkpoints and is not affected). LiteLLM's proxy is such code: its auth wraps every request in
a context variable that it resets from `finally`, and on this machine's 3.11 it died this way
under the migration tests' traffic.

The remedy here takes the collector away from allocations: automatic collection off, and a
daemon thread that collects on a timer. A collection on that thread cannot begin inside another
thread's `ContextVar.set` (that thread holds the GIL for the whole call), and a finaliser it
runs sets variables in the collector thread's own context, never the one being written. The
cost is a collection every `interval_s` instead of every few hundred allocations: cyclic
garbage lives up to that long.
"""

from __future__ import annotations

import gc
import sys
import threading
import time

AFFECTED = sys.version_info < (3, 12)
FULL_EVERY = 100  # ticks between full collections; every 10th collects the middle generation


def collect_on_a_thread(interval_s: float = 0.05) -> threading.Thread | None:
    """Turn automatic collection off and start the collector thread (named `gc-collector`);
    the thread, or None where this interpreter needs no remedy (3.12 and later). Call it
    once, first thing in the process."""
    if not AFFECTED:
        return None
    gc.disable()
    thread = threading.Thread(target=_collect_forever, args=(interval_s,), name="gc-collector", daemon=True)
    thread.start()
    return thread


def _collect_forever(interval_s: float) -> None:
    """The generations collected as the automatic collector would weigh them: the youngest
    every tick, the middle one every tenth, all of them every `FULL_EVERY`th."""
    tick = 0
    while True:
        time.sleep(interval_s)
        tick += 1
        generation = 2 if tick % FULL_EVERY == 0 else 1 if tick % 10 == 0 else 0
        gc.collect(generation)
