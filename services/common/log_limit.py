"""Per-request log lines that a flood cannot turn into a wall of text.

A warning written once per request (a shadow mismatch, a refused body, a fail-open middleware
that failed, a rejected admin token) is one line when it is rare and thousands a second when
it is not: the same fault, said again, scrolling away everything else in the log. A
production log says it once a second instead. `RateLimitedLog` does that for one kind of
event:

- every event is one line at DEBUG, with its full detail (what `spine demo` keeps in its run
  directory's log, and what `-v`-style DEBUG logging shows);
- at `level` (WARNING unless said), at most one line per key every `every_s` seconds: the
  first event of a quiet key at once, as it would have been written anyway; while more come
  within the second, they are counted and, once the second is up, one line says how many
  and what the first of them was ("12 shadow mismatches in the last second, first: ...").

The key is what a reader tells apart (a layout pair, a component, a tenant's rule), so one
noisy source does not hide another. Keys should come from a bounded set (config names,
layouts), not from a client; quiet keys are forgotten once there are more than `max_keys`.

The summary of a busy second is written by a timer thread when the second is up, so the
last count is not held back until the next event; `flush()` writes whatever is pending now
(on close, and in tests).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from services.common.thread_names import name_os_thread


@dataclass
class _Key:
    quiet_until: float                      # no line at `level` before then
    count: int = 0                          # events since the last line, not written yet
    first: tuple[str, tuple[Any, ...]] | None = None  # the first of them: (message, args)
    timer: threading.Timer | None = None


class RateLimitedLog:
    """One kind of per-request event on `logger`: all at DEBUG, at most one line per key per
    `every_s` at `level`. `plural` names the events in a summary ("shadow mismatches")."""

    def __init__(self, logger: logging.Logger, plural: str, *, every_s: float = 1.0,
                 level: int = logging.WARNING, clock: Callable[[], float] = time.monotonic,
                 max_keys: int = 1024) -> None:
        if every_s <= 0:
            raise ValueError(f"every_s: expected a positive number of seconds, got {every_s!r}")
        self.logger = logger
        self.plural = plural
        self.every_s = every_s
        self.level = level
        self._clock = clock
        self._max_keys = max_keys
        self._lock = threading.Lock()
        self._keys: dict[Hashable, _Key] = {}
        self.events = 0  # every event ever offered (tests, reports)
        self.lines = 0   # lines written at `level`

    def __call__(self, key: Hashable, message: str, *args: Any, detail: Callable[[], str] | None = None,
                 exc_info: BaseException | bool | None = None) -> None:
        """One event: `message % args` is its line at `level`; `detail()`, when given, its
        fuller line at DEBUG (only built when DEBUG is on). `exc_info` goes with the DEBUG
        line and with a line written at once, never with a summary."""
        if self.logger.isEnabledFor(logging.DEBUG):
            if detail is not None:
                self.logger.debug("%s", detail(), exc_info=exc_info, stacklevel=2)
            else:
                self.logger.debug(message, *args, exc_info=exc_info, stacklevel=2)
        now = self._clock()
        with self._lock:
            self.events += 1
            state = self._keys.get(key)
            if state is None or (state.count == 0 and now >= state.quiet_until):
                if state is None:
                    self._forget_quiet(now)
                self._keys[key] = _Key(now + self.every_s)
                self.lines += 1
                write_now = True
            else:
                state.count += 1
                if state.first is None:
                    state.first = (message, args)
                if state.timer is None:
                    state.timer = threading.Timer(max(0.0, state.quiet_until - now), self._summarize, (key,))
                    state.timer.daemon = True
                    state.timer.name = "log-summary"
                    state.timer.start()
                write_now = False
        if write_now:
            self.logger.log(self.level, message, *args, exc_info=exc_info, stacklevel=2)

    def flush(self) -> None:
        """Write every pending summary now."""
        with self._lock:
            keys = [key for key, state in self._keys.items() if state.count]
        for key in keys:
            self._summarize(key, cancel=True)

    def _summarize(self, key: Hashable, cancel: bool = False) -> None:
        if not cancel:
            name_os_thread()
        with self._lock:
            state = self._keys.get(key)
            if state is None or not state.count or state.first is None:
                return
            count, (message, args) = state.count, state.first
            if cancel and state.timer is not None:
                state.timer.cancel()
            state.count, state.first, state.timer = 0, None, None
            state.quiet_until = self._clock() + self.every_s
            self.lines += 1
        if count == 1:
            self.logger.log(self.level, message, *args)
        else:
            span = "second" if self.every_s == 1 else f"{self.every_s:g}s"
            self.logger.log(self.level, f"%d %s in the last {span}, first: {message}", count, self.plural, *args)

    def _forget_quiet(self, now: float) -> None:
        """Past `max_keys`, drop the keys with nothing pending whose quiet time is over."""
        if len(self._keys) < self._max_keys:
            return
        for key in [key for key, state in self._keys.items() if not state.count and now >= state.quiet_until]:
            del self._keys[key]
