"""The micro-batcher for callers on one event loop: a batch is a pass of the loop, no leader.

`monolith.batcher.MicroBatcher` combines callers on threads: one of them leads, waits for
more and decides for all, handing results back through locks. On an event loop nothing
needs handing: every request served there is a task of the same thread, and the requests a
pass of the loop made ready (their bodies read in one `select`) run one after another before
the next pass. So a caller queues its item and the batch is decided by one callback
scheduled behind them (`call_soon`): everything queued in that pass, up to `max_batch`, is
decided at once, and each caller's future gets its result.

The same rules as the threaded batcher otherwise: a caller with nothing queued and no other
request in flight is decided at once, inline, with no future and no callback (a lone
client pays nothing); and while a wait is free (`patient`: the models the queued requests
name already have a full batch waiting, so admitted a few ms later they lose no model time)
and more requests are expected than are queued, the batch waits up to `max_wait_s` for
more — ended early by a full batch, or by an item that may not wait.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from typing import TypeVar

from monolith.batcher import BatcherClosed, BatchRules, Decide

T = TypeVar("T")
R = TypeVar("R")


class LoopBatcher(BatchRules[T, R]):
    """Decides items queued on `loop` in batches with `decide(items) -> one result per item`;
    a result that is an exception is raised in its caller alone."""

    def __init__(self, loop: asyncio.AbstractEventLoop, decide: Decide[T, R], *,
                 max_batch: int = 32, max_wait_s: float = 0.0, expected: Callable[[], int] | None = None,
                 patient: Callable[[Sequence[T]], bool] | None = None) -> None:
        super().__init__(decide, max_batch=max_batch, max_wait_s=max_wait_s, expected=expected, patient=patient)
        self.loop = loop
        self._pending: deque[tuple[T, asyncio.Future[R]]] = deque()
        self._scheduled: asyncio.Handle | None = None  # the batch's decision, soon or after a wait
        self._waiting = False  # `_scheduled` is a wait for more (a timer), not the next pass
        self._closed = False

    async def submit(self, item: T) -> R:
        """`item`'s result, decided with whatever else this pass of the loop queued."""
        if self._closed:
            raise BatcherClosed("the batcher is closed (shutting down)")
        if not self._pending and (self._expected is None or self._expected() <= 1):
            return self._alone(item)
        future: asyncio.Future[R] = self.loop.create_future()
        self._pending.append((item, future))
        if self._scheduled is None:
            self._schedule()
        elif self._waiting and self._wait_can_end(len(self._pending), item):
            self._scheduled.cancel()  # the wait can end: decide with the next pass
            self._scheduled, self._waiting = self.loop.call_soon(self._run), False
        return await future

    def close(self) -> None:
        """Refuse new items; items already queued are still decided."""
        self._closed = True

    @property
    def queued(self) -> int:
        return len(self._pending)

    # -- deciding ---------------------------------------------------------------------------
    def _alone(self, item: T) -> R:
        """Nothing queued, nothing else in flight: a batch of one, decided here and now."""
        results = self._decide([item])
        self._count(1, waited=False)
        value = results[0]
        if isinstance(value, BaseException):
            raise value
        return value

    def _schedule(self) -> None:
        """The next decision: after a wait while one is free, else with the next pass."""
        items = [item for item, _ in self._pending]
        if len(items) < self.max_batch and self._may_wait(items):
            self._scheduled, self._waiting = self.loop.call_later(self.max_wait_s, self._run), True
        else:
            self._scheduled, self._waiting = self.loop.call_soon(self._run), False

    def _run(self) -> None:
        waited, self._scheduled, self._waiting = self._waiting, None, False
        batch = [self._pending.popleft() for _ in range(min(self.max_batch, len(self._pending)))]
        live = [(item, future) for item, future in batch if not future.done()]  # a caller that left is skipped
        if live:
            try:
                results = self._decide([item for item, _ in live])
            except BaseException as error:  # every caller of this batch gets it
                results = [error] * len(live)
            for (_, future), result in zip(live, results, strict=True):
                if future.done():
                    continue
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)
            self._count(len(live), waited)
        if self._pending:
            self._schedule()
