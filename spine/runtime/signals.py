"""Waiting for SIGTERM/SIGINT in a way that cannot deadlock.

A signal handler runs in the main thread between two bytecodes — possibly while that
thread is inside `threading.Event.wait()` holding the event's lock, so calling
`Event.set()` from the handler deadlocks (seen here: a child that ignored every SIGTERM
after its supervisor died). The handler only appends to a list; the main thread polls it.
"""

from __future__ import annotations

import signal
import time


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
