"""Waiting for SIGTERM/SIGINT in a way that cannot deadlock.

A signal handler runs in the main thread between two bytecodes — possibly while that
thread is inside `threading.Event.wait()` holding the event's lock, so calling
`Event.set()` from the handler deadlocks (seen here: a child that ignored every SIGTERM
after its supervisor died). The handler only appends to a list; the main thread polls it.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class Termination:
    """Install once, early; `wait()` returns the first SIGTERM/SIGINT received."""

    def __init__(self) -> None:
        self.received: list[int] = []
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.received.append(signum)  # no locks in a signal handler

    def wait(self, poll_s: float = 0.1) -> int:
        while not self.received:
            time.sleep(poll_s)  # interrupted by the signal itself; the loop then sees it
        return self.received[0]


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so every child is stopped on the way out (Python's own
    SIGTERM ends the process at once: `finally` blocks never run and children are orphaned).

    SIGINT too, when the process was started with it ignored: a shell script's `cmd &` starts
    its job so (POSIX), and Python keeps an ignored SIGINT ignored, so `kill -INT` of a demo
    started that way did nothing at all. A command that asks for these signals takes them
    back, as Go's `signal.Notify` does."""
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, interrupt)}
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, interrupt)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextmanager
def uninterrupted() -> Iterator[None]:
    """Ctrl-C and SIGTERM ignored meanwhile (where signals can be set: the main thread), so a
    second signal cannot cut a cleanup short."""
    try:
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:
        previous = {}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
