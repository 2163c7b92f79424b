"""Test parts for counting log lines: what a logger wrote, and whether a flood was summarized.

No tests here. `LogLines` collects every record of a logger (DEBUG included) for the length
of a `with`; `assert_summarized` checks what `services.common.log_limit.RateLimitedLog`
promises for a flood of `events`: each one a DEBUG line, and at the louder level at most one
line per key per second whose counts ("N ... in the last second") add up to `events`.
"""

from __future__ import annotations

import logging
import math
import re
import time
from types import TracebackType

from services.common.log_limit import RateLimitedLog


class LogLines(logging.Handler):
    """Every record `logger` writes while in the `with` (its level lowered to DEBUG meanwhile).
    `limiters`: flushed first, so what an earlier test left pending is not counted here."""

    def __init__(self, logger: str, *limiters: RateLimitedLog) -> None:
        super().__init__(logging.DEBUG)
        self.limiters = limiters
        self.logger = logging.getLogger(logger)
        self.records: list[logging.LogRecord] = []
        self._level = self.logger.level
        self.started = 0.0

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> LogLines:
        for limiter in self.limiters:
            limiter.flush()
        self._level = self.logger.level
        self.logger.setLevel(logging.DEBUG)
        self.logger.addHandler(self)
        self.started = time.monotonic()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self._level)

    def at(self, level: int, containing: str = "") -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == level and containing in r.getMessage()]


def assert_summarized(lines: LogLines, limiter: RateLimitedLog, events: int, *, keys: int = 1,
                      containing: str = "") -> list[str]:
    """The flood of `events` (all offered to `limiter`, across `keys` keys) as a production log
    should say it; the louder lines, for more checks."""
    limiter.flush()
    elapsed = time.monotonic() - lines.started
    debug = lines.at(logging.DEBUG, containing)
    assert len(debug) == events, (len(debug), events, debug[:3])
    loud = [message for message in lines.at(limiter.level) if containing in message or limiter.plural in message]
    # At most one line per key per second (a first line at once, then one per second up).
    assert 1 <= len(loud) <= keys * (1 + math.ceil(elapsed / limiter.every_s)), (len(loud), elapsed, loud[:5])
    assert len(loud) < events
    counted = 0
    for message in loud:
        summary = re.match(rf"(\d+) {re.escape(limiter.plural)} in the last ", message)
        counted += int(summary.group(1)) if summary else 1
    assert counted == events, loud
    return loud
