"""Fair sharing between tenants inside one priority class: a queue per tenant, admitted by
weighted round robin.

Why: within a class the model's queue was one FIFO, so a tenant sending ten times another's
rate filled it, and every request of the other waited behind the whole backlog (or found the
queue full and was refused). Now each tenant has its own queue in each class, and the class
hands out admissions between the tenants waiting in it in proportion to their weights
(`ratelimit.tenants.<tenant>.share_weight`, the tier's weight; 1 by default): a tenant
asking for less than its share is admitted at its next turn, whatever the others send.

The order is stride scheduling (Waldspurger & Weihl, 1995), the deterministic form of
weighted fair queuing: each tenant has a *pass*; the tenant with the lowest pass is admitted
and its pass grows by 1 / weight. The lane's virtual time is the pass of the last tenant
admitted; a tenant that starts waiting again starts from there, never from a pass it left
behind while idle, so it cannot bank turns by staying away, and cannot lose its turn to a
backlog that built up while it was away. Ties go to the request that arrived first, so with
one tenant (or no tenants: the layered model called directly) the lane is the FIFO it was.

Counted in admissions, not tokens: a request's cost is not known when it is admitted (it may
stop early), and the tenants' requests in one class are alike enough that turns are shares.

A full queue is shared the same way (`evict_for`): an arriving request may take the place of
the newest request of the tenant that holds the most of its class per unit of weight, when
that tenant holds more than the arrival's would after joining. A flooder fills the queue;
the others still get in, and the request refused is the flooder's newest.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")
Entry = tuple[float, int, T]  # (arrived, sequence number, item)


@dataclass
class _TenantQueue(Generic[T]):
    weight: float
    pass_: float
    entries: deque[Entry[T]] = field(default_factory=deque)


class FairLane(Generic[T]):
    """One priority class's waiting items, a queue per tenant (not thread-safe: the caller locks)."""

    def __init__(self) -> None:
        self._waiting: dict[str, _TenantQueue[T]] = {}  # tenants with items waiting
        self._idle_passes: dict[str, float] = {}  # tenants that waited lately, ahead of the lane
        self._vtime = 0.0
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[T]:
        for queue in self._waiting.values():
            for _, _, item in queue.entries:
                yield item

    def push(self, entry: Entry[T], tenant: str, weight: float) -> None:
        queue = self._waiting.get(tenant)
        if queue is None:
            start = max(self._idle_passes.pop(tenant, self._vtime), self._vtime)
            queue = self._waiting[tenant] = _TenantQueue(weight, start)
        queue.weight = weight  # the latest weight the tenant's requests came with
        queue.entries.append(entry)
        self._size += 1

    def oldest(self) -> tuple[float, int] | None:
        """(arrived, sequence) of the item that has waited longest (what aging looks at)."""
        heads = [queue.entries[0][:2] for queue in self._waiting.values()]
        return min(heads) if heads else None

    def peek(self) -> T:
        """The item `pop` would return (the lane must not be empty)."""
        return self._next()[1].entries[0][2]

    def _next(self) -> tuple[str, _TenantQueue[T]]:
        return min(self._waiting.items(),
                   key=lambda kv: (kv[1].pass_, len(kv[1].entries) / kv[1].weight, kv[1].entries[0][:2]))

    def pop(self) -> T | None:
        """The next tenant's oldest item: the lowest pass; a tie to the tenant with the shorter
        queue for its weight (one asking for less than its share goes before a backlog that
        reached the same turn), then to the earlier arrival."""
        if not self._waiting:
            return None
        tenant, queue = self._next()
        _, _, item = queue.entries.popleft()
        self._size -= 1
        self._vtime = max(self._vtime, queue.pass_)
        queue.pass_ += 1.0 / queue.weight
        if not queue.entries:
            del self._waiting[tenant]
            self._idle_passes[tenant] = queue.pass_
        self._forget_idle()
        return item

    def remove_if(self, predicate: Callable[[T], bool]) -> list[T]:
        """Drop and return every waiting item for which `predicate(item)` is true."""
        removed: list[T] = []
        for tenant, queue in list(self._waiting.items()):
            kept: deque[Entry[T]] = deque()
            for entry in queue.entries:
                if predicate(entry[2]):
                    removed.append(entry[2])
                else:
                    kept.append(entry)
            queue.entries = kept
            if not kept:
                del self._waiting[tenant]
                self._idle_passes[tenant] = queue.pass_
        self._size -= len(removed)
        return removed

    def evict_for(self, tenant: str, weight: float) -> T | None:
        """Make room for one item of `tenant`: the newest item of the tenant holding the most of
        this lane per unit of weight, when it holds more than `tenant` would after joining;
        None when no tenant does (the arrival is the one to refuse)."""
        own = self._waiting.get(tenant)
        joining = ((len(own.entries) if own is not None else 0) + 1) / weight
        heaviest: tuple[float, str] | None = None
        for name, queue in self._waiting.items():
            share = len(queue.entries) / queue.weight
            if name != tenant and share > joining and (heaviest is None or share > heaviest[0]):
                heaviest = (share, name)
        if heaviest is None:
            return None
        queue = self._waiting[heaviest[1]]
        _, _, item = queue.entries.pop()
        self._size -= 1
        if not queue.entries:
            del self._waiting[heaviest[1]]
            self._idle_passes[heaviest[1]] = queue.pass_
        return item

    def by_tenant(self) -> dict[str, int]:
        """Items waiting per tenant (for tests and status)."""
        return {tenant: len(queue.entries) for tenant, queue in self._waiting.items()}

    def _forget_idle(self) -> None:
        """Idle tenants the lane has caught up with start from its virtual time anyway."""
        if self._idle_passes:
            for tenant in [t for t, p in self._idle_passes.items() if p <= self._vtime]:
                del self._idle_passes[tenant]


# A tenant that sent a request this recently still counts for the shares of the slots,
# though none of its requests waits or runs right now.
ACTIVE_S = 1.0
SEEN_MAX = 256  # tenants remembered before the quiet ones are dropped at an ask


class SlotShares:
    """Which tenants share the KV slots now, and how many each runs: whether a tenant is below
    its weight's share of the slots, among the tenants running or active in the last
    ACTIVE_S — alone, its share is every slot. The scheduler keeps its last free slots
    (`inference.share_headroom_slots`) for a tenant below its share, so a flooder never holds
    them all and another tenant's request starts at the next step. Not thread-safe."""

    def __init__(self) -> None:
        self._running: Counter[str] = Counter()
        self._seen: dict[str, tuple[float, float]] = {}  # tenant -> (last asked, weight)

    def asked(self, tenant: str, weight: float, now: float) -> None:
        self._seen[tenant] = (now, weight)
        if len(self._seen) > SEEN_MAX:  # many tenants, and the shares rarely asked: stay bounded
            self._forget_quiet(now)

    def started(self, tenant: str) -> None:
        self._running[tenant] += 1

    def ended(self, tenant: str) -> None:
        self._running[tenant] -= 1

    def below_share(self, tenant: str, weight: float, slots: int, now: float) -> bool:
        self._forget_quiet(now)
        total = sum(seen_weight for _, seen_weight in self._seen.values()) or weight
        return self._running[tenant] < slots * weight / total

    def _forget_quiet(self, now: float) -> None:
        for tenant, (seen, _) in list(self._seen.items()):
            if now - seen > ACTIVE_S and self._running[tenant] <= 0:
                del self._seen[tenant]
                self._running.pop(tenant, None)
