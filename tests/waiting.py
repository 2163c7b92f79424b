"""How a test waits: for a condition, never for a fixed time, and on a clock it can move.

`eventually` polls a condition until it holds (or fails with what was awaited and what was
last seen) — the one wait helper of the suite: a fixed sleep is either too short on a
loaded host (a flaky test) or too long everywhere else (a slow suite). Where the code under
test waits on time itself (a deadline, a backoff, a lease), it takes a clock, and the test
hands it a `ShiftedClock` it moves forward instead of sleeping.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def eventually(condition: Callable[[], T], timeout: float = 10.0, what: str = "", *, interval: float = 0.01,
               seen: Callable[[], object] | None = None) -> T:
    """Poll `condition` every `interval` seconds until it returns something true, and return
    that; after `timeout` seconds fail with `what` (and `seen()`, what there was instead).

    The timeout is a bound for a broken test on a loaded host, never a timing assertion."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            found = f"; found {seen()!r}" if seen is not None else ""
            raise AssertionError(f"not within {timeout:g} s: {what or getattr(condition, '__name__', 'condition')}"
                                 f"{found}")
        time.sleep(interval)


def holds_within(condition: Callable[[], object], timeout: float, *, interval: float = 0.01) -> bool:
    """Whether `condition` holds within `timeout` seconds (for a test that asserts it does not)."""
    try:
        eventually(condition, timeout, interval=interval)
    except AssertionError:
        return False
    return True


class ShiftedClock:
    """The monotonic clock plus an offset a test moves forward (`advance`), for code that takes
    a `clock`: time passes as usual, and a test skips a wait instead of sleeping through it."""

    def __init__(self) -> None:
        self._offset = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return time.monotonic() + self._offset

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._offset += seconds


class ManualClock:
    """A clock that stands still until a test moves it (`advance`)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
