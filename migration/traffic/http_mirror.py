"""Shadow traffic for the HTTP front: a copy of a share of answered requests to the other side.

As with the Gateway front's mirror (`runtime.shadow.traffic`): the client always has the primary's
answer before a copy is sent, a copy never waits for a slot (past `max_in_flight` it is
dropped and counted), and a share of the copies goes back to the primary's own side
(calibration: what differs there is noise, not a verdict on the spine). Each pair is
reduced and compared by `http_answers` and counted in the same Prometheus families
(`runtime.shadow.metrics`) the parity gate reads everywhere else.

A copy sent to the spine carries the deployment's signed shadow mark, so the spine only
dry-runs the tenant's rate limit and never writes its cache. A foreign legacy endpoint has
no such mark: a copy sent there is a real request to it (it counts against the key's limits
and spend there), which is why the share is small.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from migration.traffic.http_answers import Answer, differences, read_answer
from migration.traffic.outcomes import SIDES
from runtime.shadow.metrics import ShadowCounters

log = logging.getLogger("spine.migration.http_mirror")

# (target side, calibration) -> the target's status, body and content type (status 0: no answer)
SendCopy = Callable[[str], Awaitable[tuple[int, bytes, str]]]


@dataclass(frozen=True)
class MirrorSettings:
    share: float = 0.0  # of answered requests, 0..1
    calibration_share: float = 0.1  # of the copies, sent to the primary's own side
    max_in_flight: int = 8  # copies in flight at once; past it dropped, never queued
    timeout_s: float = 10.0  # a copy's whole budget
    ignore_fields: tuple[str, ...] = ()  # of http_answers.FIELDS


@dataclass(frozen=True)
class HttpMismatch:
    primary_side: str
    shadow_side: str
    calibration: bool
    fields: tuple[str, ...]
    primary: Answer
    shadow: Answer


class HttpMirror:
    """Decides which answered requests are copied, sends the copies on the front's event loop,
    compares and counts. Every method runs on that loop (no locks needed)."""

    def __init__(self, settings: MirrorSettings, rng: random.Random | None = None,
                 sides: Sequence[str] = SIDES, history: int = 1000, names: Mapping[str, str] | None = None) -> None:
        if not 0.0 <= settings.share <= 1.0:
            raise ValueError(f"shadow share: must be between 0 and 1, got {settings.share}")
        self.settings = settings
        self.share = settings.share
        self.sides = tuple(sides)
        self._rng = rng or random.Random()
        self._in_flight = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self.counters = ShadowCounters()
        self.counters.expect((side, self._other(side)) for side in self.sides)
        self.mismatches: list[HttpMismatch] = []
        self._history = history
        self._names = dict(names or {})  # how a side is called in the log (the front: "legacy")

    def pick(self) -> bool:
        """Whether the request now being answered is to be copied (decided when it arrives, so
        only a picked answer is kept whole)."""
        return self.share > 0.0 and self._rng.random() < self.share

    def offer(self, primary_side: str, primary: Answer, greedy: bool, send: SendCopy) -> bool:
        """Copy one answered request (already picked) to the other side, or to its own for
        calibration; False when dropped (every slot busy)."""
        calibration = self._rng.random() < self.settings.calibration_share
        target = primary_side if calibration else self._other(primary_side)
        if self._in_flight >= self.settings.max_in_flight:
            self.counters.skipped(primary_side, target, calibration, "saturated")
            return False
        self._in_flight += 1
        task = asyncio.ensure_future(self._copy(primary_side, target, calibration, primary, greedy, send))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def _copy(self, primary_side: str, target: str, calibration: bool, primary: Answer, greedy: bool,
                    send: SendCopy) -> None:
        try:
            status, body, content_type = await asyncio.wait_for(send(target), self.settings.timeout_s)
            shadow = read_answer(status, body, content_type)
        except Exception as error:  # a copy that failed to be sent says nothing about the answers
            self.counters.skipped(primary_side, target, calibration, "call_failed")
            log.warning("shadow copy to %s failed: %s", target, type(error).__name__)
            return
        finally:
            self._in_flight -= 1
        self.compare(primary_side, target, calibration, primary, shadow, greedy)

    def compare(self, primary_side: str, shadow_side: str, calibration: bool, primary: Answer, shadow: Answer,
                greedy: bool) -> tuple[str, ...]:
        """Count one pair; the fields that differed (none when a side failed: not compared)."""
        if primary.layout_failure or shadow.layout_failure:
            self.counters.skipped(primary_side, shadow_side, calibration, "layout_error")
            return ()
        fields = differences(primary, shadow, greedy, self.settings.ignore_fields)
        self.counters.compared(primary_side, shadow_side, calibration, fields)
        if fields:
            self.mismatches = [*self.mismatches[-(self._history - 1):],
                               HttpMismatch(primary_side, shadow_side, calibration, fields, primary, shadow)]
            log.warning("shadow mismatch%s on %s: %s answered %s %s; %s answered %s %s",
                        " (calibration)" if calibration else "", ", ".join(fields),
                        self._names.get(primary_side, primary_side), primary.status, primary.error_type or "-",
                        self._names.get(shadow_side, shadow_side), shadow.status,
                        shadow.error_type or "-")
        return fields

    def idle(self) -> bool:
        """No copy in flight (read from any thread: a plain int the loop keeps)."""
        return self._in_flight == 0

    async def drain(self, timeout_s: float = 10.0) -> None:
        """Wait for the copies in flight (an orderly stop)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)

    def _other(self, side: str) -> str:
        return next(s for s in self.sides if s != side)
