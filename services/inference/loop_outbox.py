"""A job's outputs for a consumer on an event loop, handed over once per model step.

A consumer on a thread waits on its job's `queue.Queue`: the scheduler's `put` wakes that
thread, once per token for a stream. A consumer on an event loop (the HTTP API's request,
served on its loop from accept to answer) cannot block on a queue, and waking its loop from
the scheduler thread costs a `call_soon_threadsafe` — a write to the loop's self-pipe and a
pass of the selector. So the scheduler appends each output to its job's `LoopOutbox` as it
comes and, once the step's outputs are all out, wakes each loop once for every job of that
loop that got something (`StepHandoff.flush`): one wake-up per loop per step, however many
streams the batch holds. A failure (a cancel, a deadline, a slow reader) wakes its consumer
at once, from whichever thread found it.

Ordering holds without a lock: the deque's append and popleft are atomic, the consumer
checks for an item and sets its waiter in one synchronous pass on its loop, and the wake is
a callback that runs on that loop after the append that asked for it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any


class LoopOutbox:
    """One job's unread outputs, read on `loop`."""

    __slots__ = ("loop", "_items", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None  # touched on the loop only

    # -- the scheduler's side (any thread) --------------------------------------------------
    def add(self, item: Any) -> None:
        """An output of this step: its consumer is woken when the step's hand-off flushes."""
        self._items.append(item)

    def put_nowait(self, item: Any) -> None:
        """An item its consumer must see now (the end of a failed job): woken at once."""
        self._items.append(item)
        try:
            self.loop.call_soon_threadsafe(self.wake)
        except RuntimeError:  # the loop has closed: nobody is left to read
            pass

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)

    # -- the loop's side ----------------------------------------------------------------------
    def wake(self) -> None:
        """On the loop: the waiting consumer, if any, looks again."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self, timeout: float) -> Any:
        """The next item, or None when nothing came within `timeout` seconds."""
        if not self._items:
            waiter = self._waiter = self.loop.create_future()
            timer = self.loop.call_later(timeout, self.wake)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
            if not self._items:
                return None
        return self._items.popleft()


class StepHandoff:
    """The scheduler thread's record of one step's deliveries to event loops: `deliver` as
    the outputs come, `flush` once the step is done — one `call_soon_threadsafe` per loop."""

    def __init__(self) -> None:
        self._touched: dict[asyncio.AbstractEventLoop, list[LoopOutbox]] = {}

    def deliver(self, outbox: LoopOutbox, item: Any) -> None:
        outbox.add(item)
        self._touched.setdefault(outbox.loop, []).append(outbox)

    def flush(self) -> None:
        if not self._touched:
            return
        touched, self._touched = self._touched, {}
        for loop, outboxes in touched.items():
            try:
                loop.call_soon_threadsafe(_wake_all, outboxes)
            except RuntimeError:  # that loop has closed: nobody is left to read
                pass


def _wake_all(outboxes: list[LoopOutbox]) -> None:
    for outbox in outboxes:
        outbox.wake()
