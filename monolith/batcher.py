"""The micro-batcher: concurrent callers hand in items, one of them decides a batch for all.

Flat combining, no batcher thread: the first caller to find no batch in progress becomes
the leader; it takes what is queued (up to `max_batch`), optionally waits up to
`max_wait_s` after the batch's first arrival for more, decides the batch in its own
thread, hands each caller its result and passes leadership to the oldest caller still
waiting. So a lone request is decided at once in its own thread (no hop, no wait), and
under load the requests that arrive while a batch is being decided form the next one.

The wait for more only happens while more requests are expected: `expected()` (e.g.
requests in flight in the gateway) exceeds what is already queued. A closed loop of one
client never waits; 64 clients with most requests in the model do. And, where `patient`
is given, only while it says a wait is free for the items queued: the spine asks whether
the models they name have a backlog (a batch admitted a few ms later still finds work
queued before it, so the wait costs no model time, and the batch spreads each step's
cold start over many requests).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class BatcherClosed(RuntimeError):
    """The batcher is shutting down and takes no new items."""


class _Slot(Generic[T]):
    """One caller's item. `wake` is a plain lock taken at creation: the caller blocks on
    it, and whoever has its answer (or leadership) for it releases it exactly once — half
    the cost of an Event, which builds a Condition and a waiter lock per wait."""

    __slots__ = ("item", "arrived", "wake", "done", "value", "error")

    def __init__(self, item: T, arrived: float) -> None:
        self.item = item
        self.arrived = arrived
        self.wake = threading.Lock()
        self.wake.acquire()
        self.done = False
        self.value: object = None
        self.error: BaseException | None = None


@dataclass
class BatchStats:
    """Counts for tuning and tests: how many batches, of what sizes."""

    batches: int = 0
    items: int = 0
    largest: int = 0
    waited: int = 0  # batches whose leader waited for more items

    @property
    def mean_size(self) -> float:
        return self.items / self.batches if self.batches else 0.0

    def plus(self, other: BatchStats) -> BatchStats:
        """Both counts together (batchers that share one stream of requests)."""
        return BatchStats(self.batches + other.batches, self.items + other.items,
                          max(self.largest, other.largest), self.waited + other.waited)


Decide = Callable[[list[T]], Sequence[R | BaseException]]


class BatchRules(Generic[T, R]):
    """What every micro-batcher decides by, whoever runs it (threads here, an event loop in
    `monolith.loop_batcher`): its settings, checked once; when a batch may wait for more and
    when that wait can end; the counts; and `decide` held to one result per item. Why one
    place: the two batchers must batch alike, or a request would be admitted differently by
    the front that happened to read it."""

    def __init__(self, decide: Decide[T, R], *, max_batch: int, max_wait_s: float,
                 expected: Callable[[], int] | None, patient: Callable[[Sequence[T]], bool] | None) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch: must be >= 1, got {max_batch}")
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s: must be >= 0, got {max_wait_s}")
        self._decide_items = decide
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self._expected = expected
        self._patient = patient
        self.stats = BatchStats()

    def _may_wait(self, queued: Sequence[T]) -> bool:
        """Whether a batch of `queued` items may wait for more: waiting is on, more are
        expected, and (where asked) a wait is free for these items now."""
        return (self.max_wait_s > 0 and self._more_expected(len(queued))
                and (self._patient is None or self._patient(queued)))

    def _wait_can_end(self, queued: int, arrived: T) -> bool:
        """Whether a wait for more ends with `arrived`: the batch is full, nothing more is
        expected, or the item may not wait (say, of the latency class)."""
        return (queued >= self.max_batch or not self._more_expected(queued)
                or (self.max_wait_s > 0 and self._patient is not None and not self._patient((arrived,))))

    def _more_expected(self, queued: int) -> bool:
        return self._expected is not None and self._expected() > queued

    def _decide(self, items: list[T]) -> list[R | BaseException]:
        """`decide(items)`, held to one result per item (RuntimeError otherwise)."""
        results = list(self._decide_items(items))
        if len(results) != len(items):
            raise RuntimeError(f"decide returned {len(results)} results for {len(items)} item"
                               f"{'' if len(items) == 1 else 's'}")
        return results

    def _count(self, items: int, waited: bool) -> None:
        """A batch of `items` decided (a threaded batcher's caller holds its lock)."""
        self.stats.batches += 1
        self.stats.items += items
        self.stats.largest = max(self.stats.largest, items)
        self.stats.waited += waited


class MicroBatcher(BatchRules[T, R]):
    """Decides items in batches with `decide(items) -> one result per item`.

    A result that is an exception is raised in its caller alone; an exception raised by
    `decide` itself goes to every caller of that batch.
    """

    def __init__(self, decide: Decide[T, R], *, max_batch: int = 32,
                 max_wait_s: float = 0.0, expected: Callable[[], int] | None = None,
                 patient: Callable[[Sequence[T]], bool] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(decide, max_batch=max_batch, max_wait_s=max_wait_s, expected=expected, patient=patient)
        self._clock = clock
        self._lock = threading.Lock()
        self._arrival = threading.Condition(self._lock)
        self._pending: deque[_Slot[T]] = deque()
        self._leading = False
        self._closed = False

    def submit(self, item: T) -> R:
        """Block until `item` is decided; return its result (or raise its exception)."""
        with self._lock:
            if self._closed:
                raise BatcherClosed("the batcher is closed (shutting down)")
            alone = not self._leading and not self._pending and not self._may_wait((item,))
            if alone:
                self._leading = True
        if alone:
            return self._decide_alone(item)
        with self._lock:
            slot: _Slot[T] = _Slot(item, self._clock())
            self._pending.append(slot)
            lead = not self._leading
            if lead:
                self._leading = True
            elif self._wait_can_end(len(self._pending), item):
                # Wake a leader waiting for more only when its wait can end: the batch is
                # full, or nothing more is expected. Waking it on every arrival made it take
                # the GIL once per request just to go back to sleep — under load each such
                # wake-up is a hand-off the model's thread pays for (more CPU per request, less
                # throughput at high concurrency). An item that may not wait (say, of
                # the latency class) ends the wait too: the batch is decided with it.
                self._arrival.notify()
        if not lead:
            slot.wake.acquire()
        if not slot.done:  # leading (from the start, or handed over)
            self._lead(slot)
        if slot.error is not None:
            raise slot.error
        return slot.value  # type: ignore[return-value]

    def close(self) -> None:
        """Refuse new items; items already queued are still decided."""
        with self._lock:
            self._closed = True

    @property
    def queued(self) -> int:
        return len(self._pending)

    # -- leading ----------------------------------------------------------------------
    def _decide_alone(self, item: T) -> R:
        """Nothing queued and nothing more expected: a batch of one, decided here without a
        slot or a hand-off (the common case at low load). Leading all the same: items that
        arrive meanwhile queue up, and the oldest of them decides them as the next batch."""
        try:
            result = self._decide([item])
        finally:
            with self._lock:
                self._count(1, waited=False)
                self._hand_over()
        value = result[0]
        if isinstance(value, BaseException):
            raise value
        return value

    def _lead(self, own: _Slot[T]) -> None:
        try:
            while not own.done:
                self._run(self._take())
        finally:
            with self._lock:
                if not own.done and own in self._pending:
                    # Leading failed before deciding its own item (say `expected()` raised):
                    # nobody may be handed leadership for a caller that has already left.
                    self._pending.remove(own)
                self._hand_over()

    def _take(self) -> list[_Slot[T]]:
        with self._lock:
            waited = False
            if self._pending and self._may_wait(self._items()):
                until = self._pending[0].arrived + self.max_wait_s
                while len(self._pending) < self.max_batch and self._more_expected(len(self._pending)) and (
                        not waited or self._patient is None or self._patient(self._items())):
                    left = until - self._clock()
                    if left <= 0:
                        break
                    waited = True
                    self._arrival.wait(left)
            count = min(self.max_batch, len(self._pending))
            batch = [self._pending.popleft() for _ in range(count)]
            self._count(count, waited)
        return batch

    def _hand_over(self) -> None:
        """Leading ends (the caller holds the lock): the oldest waiter, if any, decides the
        next batch; else the next arrival leads."""
        if self._pending:
            self._pending[0].wake.release()
        else:
            self._leading = False

    def _items(self) -> list[T]:
        return [slot.item for slot in self._pending]

    def _run(self, batch: list[_Slot[T]]) -> None:
        try:
            results = self._decide([slot.item for slot in batch])
        except BaseException as error:  # every caller of this batch gets it
            results = [error] * len(batch)
        for slot, result in zip(batch, results, strict=True):
            if isinstance(result, BaseException):
                slot.error = result
            else:
                slot.value = result
            slot.done = True
            slot.wake.release()
