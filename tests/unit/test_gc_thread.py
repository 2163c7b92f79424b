"""The collector on a thread of its own keeps CPython 3.11 alive where its own collector
crashes it: a finaliser that sets a context variable, freed by a collection that starts inside
another `ContextVar.set` (python/cpython#148891; the crash that took LiteLLM's proxy down).

Each case runs in a child process, since the crash is a SIGSEGV. The child makes the collector
fire on every allocation (threshold 1) so that, left alone, it dies within a fraction of a second."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from runtime.processes.gc_thread import AFFECTED

CHILD = textwrap.dedent("""
    import contextvars, gc, sys, time
    from runtime.processes.gc_thread import collect_on_a_thread

    if sys.argv[1] == "thread":
        collect_on_a_thread(0.001)
    gc.set_threshold(1)  # without the remedy: a collection at every allocation, inside set() too

    storage = contextvars.ContextVar("storage")
    pads = [contextvars.ContextVar(f"pad{i}") for i in range(40)]  # a HAMT several levels deep
    for var in pads:
        var.set(object())

    class SetsOnFree:
        def __del__(self):
            storage.set(object())
            for var in pads[:8]:
                var.set(object())

    def garbage_cycle():
        holder = SetsOnFree()
        holder.cycle = [holder]  # freed by the cyclic collector only

    freed = 0
    deadline = time.monotonic() + float(sys.argv[2])
    while time.monotonic() < deadline:
        garbage_cycle()
        for var in pads:
            var.set(object())
        freed += 1
    gc.collect()
    print("survived", freed)
""")

pytestmark = pytest.mark.skipif(not AFFECTED, reason="CPython 3.12 and later collect at the eval loop's checkpoints")


def run_child(mode: str, seconds: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", CHILD, mode, str(seconds)], capture_output=True, text=True,
                          timeout=60)


def test_the_interpreters_own_collector_crashes_on_the_pattern() -> None:
    """The control: without the remedy the pattern is fatal, so the next test can tell."""
    died = run_child("allocations", 10.0)
    assert died.returncode == -signal.SIGSEGV, (died.returncode, died.stdout, died.stderr[-500:])


def test_collecting_on_a_thread_survives_the_same_pattern() -> None:
    lived = run_child("thread", 2.0)
    assert lived.returncode == 0, (lived.returncode, lived.stderr[-500:])
    assert lived.stdout.startswith("survived ") and int(lived.stdout.split()[1]) > 1000
