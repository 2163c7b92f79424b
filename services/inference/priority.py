"""Priority classes for the inference queue, with aging so the lowest class never starves.

Classes (the `priority` field of GenerateRequest):

* ``1``  latency-sensitive — admitted first;
* ``0``  default;
* ``-1`` throughput — admitted when nothing more urgent waits.

**Aging rule.** A waiting job's *effective* class is its own class plus one for every
`aging_ms` it has waited, capped at the top class (1). Below the top class, jobs are
admitted by effective class, ties to the job that arrived first: a throughput job that
has waited `aging_ms` ranks with the default class.

A job promoted all the way to the top class (a throughput job after 2 × `aging_ms`, a
default one after `aging_ms`) is *due*. Due jobs do not jump ahead of the latency class
— with a backlog of hundreds of due throughput jobs, a latency request behind all of
them would wait seconds — they take every other admission instead: while any job is
due, admissions alternate between the oldest due job and the job the class order picks.
So a latency request waits for at most one due job per admission it needs, and a due
job is admitted within twice the number of due jobs ahead of it: the throughput class
never starves, however many latency requests keep coming.

Within one class the tenants waiting share the admissions by weight (a queue per tenant,
weighted round robin: `services.inference.fair_share`); a class's rank and aging are its
oldest job's, so picking among three classes is enough (O(tenants waiting) per admission).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from services.inference.fair_share import FairLane

LOWEST, DEFAULT, HIGHEST = -1, 0, 1
CLASSES: tuple[int, ...] = (HIGHEST, DEFAULT, LOWEST)
CLASS_NAMES = {HIGHEST: "latency", DEFAULT: "default", LOWEST: "throughput"}

T = TypeVar("T")


def priority_error(value: int) -> str | None:
    """Why `value` is not a priority class, or None when it is one."""
    if value in CLASSES:
        return None
    return (f"priority: must be -1 (throughput), 0 (default) or 1 (latency-sensitive), got {value}")


def effective_class(priority: int, waited_ms: float, aging_ms: float) -> int:
    """`priority` raised one class per `aging_ms` waited, at most to the top class."""
    if aging_ms <= 0:
        return HIGHEST
    return min(HIGHEST, priority + int(max(0.0, waited_ms) // aging_ms))


class AgingPriorityQueue(Generic[T]):
    """Waiting items by class; `pop` takes the highest effective class (see the module doc).

    Not thread-safe: the scheduler calls it under its own lock. Times are in seconds of
    whatever clock the caller uses (the scheduler's injectable clock).
    """

    def __init__(self, aging_ms: float) -> None:
        self.aging_ms = aging_ms
        self._lanes: dict[int, FairLane[T]] = {c: FairLane() for c in CLASSES}
        self._seq = 0
        self._due_served = False  # whether the last admission went to a due job

    def push(self, item: T, priority: int, now: float, tenant: str = "", weight: float = 1.0) -> None:
        """Queue `item` in its class, in `tenant`'s queue there (`weight`: its share of the class)."""
        if priority not in self._lanes:
            raise ValueError(priority_error(priority))
        self._seq += 1
        self._lanes[priority].push((now, self._seq, item), tenant, weight)

    def pop(self, now: float, allow: Callable[[T], bool] | None = None) -> T | None:
        """The next item to admit, or None when nothing waits — or when `allow` refuses the
        item that is next (it stays where it is: nothing changes)."""
        ordered: tuple[int, float, int, int] | None = None  # (-rank, arrived, seq, lane)
        due: tuple[float, int, int] | None = None  # (arrived, seq, lane) of the oldest due head
        for lane, items in self._lanes.items():
            oldest = items.oldest()
            if oldest is None:
                continue
            arrived, seq = oldest
            effective = effective_class(lane, (now - arrived) * 1000.0, self.aging_ms)
            rank = lane if lane == HIGHEST else min(effective, HIGHEST - 1)
            key = (-rank, arrived, seq, lane)
            if ordered is None or key < ordered:
                ordered = key
            if lane < HIGHEST and effective == HIGHEST and (due is None or (arrived, seq) < due[:2]):
                due = (arrived, seq, lane)
        if ordered is None:
            return None
        its_turn = due is not None and due[2] != ordered[3] and not self._due_served
        lane = due[2] if its_turn and due is not None else ordered[3]
        if allow is not None and not allow(self._lanes[lane].peek()):
            return None
        self._due_served = due is not None and lane == due[2]
        return self._lanes[lane].pop()

    def evict_for(self, priority: int, tenant: str, weight: float = 1.0) -> T | None:
        """Room for one more of `tenant`'s class `priority` in a full queue: the item it displaces
        (`FairLane.evict_for`), or None when the arrival is the one to refuse."""
        return self._lanes[priority].evict_for(tenant, weight)

    def remove_if(self, predicate: Callable[[T], bool]) -> list[T]:
        """Drop and return every waiting item for which `predicate(item)` is true."""
        return [item for lane in self._lanes.values() for item in lane.remove_if(predicate)]

    def depth_by_class(self) -> dict[int, int]:
        return {lane: len(items) for lane, items in self._lanes.items()}

    def __len__(self) -> int:
        return sum(map(len, self._lanes.values()))

    def __iter__(self) -> Iterator[T]:
        for items in self._lanes.values():
            yield from items

    def by_tenant(self, priority: int) -> dict[str, int]:
        """Items of class `priority` waiting per tenant."""
        return self._lanes[priority].by_tenant()
