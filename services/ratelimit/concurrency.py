"""Concurrency slots: how many of a tenant's requests may be in flight at once.

A tenant with `max_concurrent_requests` holds one slot per admitted request, from its
admission (the rate limiter's `AdmitBatch`, which takes the slot as a *lease* with the same
all-or-nothing decision as the token buckets) to its answer's last byte (the pipeline's
release step gives it back with `ReleaseBatch`, whatever the outcome: answered, failed,
cancelled). A lease the release never reaches — the gateway crashed, the release call
failed — expires at the request's deadline, so a slot is never lost for longer than the
request could have run.

The limit a limiter enforces is its share of the configured one (the traffic split's rule
for every limit, `migration.limit_shares`), rounded down but never below 1, and halved while the
device is busy when `concurrency_when_busy.halve` is set (hysteresis: halved above
`above`, whole again below `below`). Slots already held are never revoked: a lower limit
only refuses new requests until enough have finished.

The table is a few Python dicts on the host, under the rate limiter's lock: a decision
needs one tenant's count, and a lease is an id with an expiry — nothing a tensor helps with.
`SlotAdmission` decides a batch's slots together with its token buckets, exactly as one by one.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import secrets
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.pipeline.batch_rpc import ItemError
from services.ratelimit.admission import AdmitItem, AdmitVerdict, OverLimit

# A lease asked for without a deadline (an asker that sent no `lease_ttl_s`).
DEFAULT_LEASE_S = 300.0
# The first guess of how long a request holds its slot, before any was released.
FIRST_HOLD_S = 1.0
# Weight of the newest hold time in a tenant's average (for retry-after).
HOLD_ALPHA = 0.2
# The least retry-after a refusal names: a client must not spin.
MIN_RETRY_S = 0.05
# How often (in takes) every tenant's expired leases are dropped, not only the asker's.
SWEEP_EVERY = 1024


@dataclass
class _Tenant:
    leases: dict[int, tuple[float, float]] = field(default_factory=dict)  # lease id -> (taken at, expires at)
    mean_hold_s: float = FIRST_HOLD_S


class ConcurrencyLeases:
    """Leases on concurrency slots, by tenant. Not thread-safe: the caller holds a lock."""

    def __init__(self, above: float = 0.9, below: float = 0.8, halve_when_busy: bool = False) -> None:
        self.share = 1.0
        self.halve_when_busy = halve_when_busy
        self.above, self.below = above, below
        self.busy = False  # the device was last seen busy (hysteresis state)
        self._tenants: dict[str, _Tenant] = {}
        self._owner: dict[int, str] = {}  # lease id -> tenant
        # Ids are unique per limiter process (a random prefix): a lease another limiter
        # handed out is never mistaken for one of ours after a restart or a move.
        self._ids = itertools.count((secrets.randbits(31) << 32) + 1)
        self._takes = 0
        # With a shared store (`services.ratelimit.leases`): the slots each tenant holds a
        # lease on from the store, enforced instead of the share (None: no store, or it is down).
        # A tenant not in it yet may take one slot until the next renewal.
        self.granted: dict[str, int] | None = None
        self.refused: Counter[str] = Counter()  # refusals since the store's last renewal

    # -- what a shared store decides (services.ratelimit.leases) ---------------------------
    def set_share(self, share: float) -> None:
        """The fraction of each configured limit this limiter enforces without a store's grants."""
        self.share = share

    def lease_from_store(self) -> None:
        """The store answers: enforce its grants (a tenant without one may take one slot)."""
        self.share = 1.0
        if self.granted is None:
            self.granted = {}

    def decide_alone(self, share: float) -> None:
        """The store is unreachable: enforce `share` of each configured limit, no grants."""
        self.share, self.granted = share, None

    def grant(self, tenant: str, slots: int | None) -> None:
        """The store's grant for `tenant` (None: it holds none and may take one slot)."""
        if self.granted is None:
            return
        if slots is None:
            self.granted.pop(tenant, None)
        else:
            self.granted[tenant] = slots

    def refusal(self, tenant: str) -> None:
        """A refusal the store hears of at its next renewal (it may grant more slots)."""
        if self.granted is not None:
            self.refused[tenant] += 1

    # -- the limit -------------------------------------------------------------------------
    def limit(self, configured: int) -> int:
        """What this limiter enforces of a configured limit: its share, halved while busy, >= 1."""
        factor = self.share * (0.5 if self.halve_when_busy and self.busy else 1.0)
        return max(1, math.floor(configured * factor + 1e-9))

    def observe_busy(self, fraction: float) -> None:
        """The device's busy fraction as an asker saw it last; moves the hysteresis."""
        if fraction > self.above:
            self.busy = True
        elif fraction < self.below:
            self.busy = False

    # -- slots -----------------------------------------------------------------------------
    def free(self, tenant: str, configured: int, now: float) -> int:
        """Slots `tenant` may still take now (its expired leases are dropped first)."""
        limit = self.limit(configured) if self.granted is None else self.granted.get(tenant, 1)
        return max(0, limit - self.held(tenant, now))

    def held(self, tenant: str, now: float) -> int:
        state = self._tenants.get(tenant)
        if state is None:
            return 0
        expired = [lease for lease, (_, expires) in state.leases.items() if expires <= now]
        for lease in expired:
            del state.leases[lease]
            self._owner.pop(lease, None)
        return len(state.leases)

    def take(self, tenant: str, now: float, ttl_s: float) -> int:
        """A new lease for `tenant`, expiring `ttl_s` from now (DEFAULT_LEASE_S when not positive)."""
        lease = next(self._ids)
        state = self._tenants.setdefault(tenant, _Tenant())
        state.leases[lease] = (now, now + (ttl_s if ttl_s > 0 else DEFAULT_LEASE_S))
        self._owner[lease] = tenant
        self._takes += 1
        if self._takes % SWEEP_EVERY == 0:
            self._sweep(now)
        return lease

    def release(self, lease: int, now: float) -> bool:
        """Give a slot back; False when the lease is not held here (released, expired, another's)."""
        tenant = self._owner.pop(lease, None)
        if tenant is None:
            return False
        state = self._tenants[tenant]
        taken, _ = state.leases.pop(lease)
        state.mean_hold_s += HOLD_ALPHA * (max(0.0, now - taken) - state.mean_hold_s)
        return True

    def retry_after(self, tenant: str, now: float) -> float:
        """When a slot of `tenant`'s should be free: its oldest lease's start plus the tenant's
        average hold time, no later than that lease's expiry and never less than MIN_RETRY_S."""
        state = self._tenants.get(tenant)
        if state is None or not state.leases:
            return MIN_RETRY_S
        taken, expires = min(state.leases.values())
        return max(MIN_RETRY_S, min(taken + state.mean_hold_s, expires) - now)

    def in_flight(self) -> dict[str, int]:
        """Leases held by tenant (for tests and status)."""
        return {tenant: len(state.leases) for tenant, state in self._tenants.items() if state.leases}

    def _sweep(self, now: float) -> None:
        for tenant in list(self._tenants):
            self.held(tenant, now)


def concurrency_limit_name(tenant: str) -> str:
    """How a refusal names a tenant's concurrency limit."""
    return f"tenant={tenant},resource=concurrent_requests"


Asking = list[tuple[int, Any]]  # (index in the batch, the item's bucket ask: a `RateLimitAsk`)
# Fills `results[index]` of every asked item with its `AdmitVerdict` or `ItemError`.
DecideBuckets = Callable[[list[Any], Asking, float], None]


class SlotAdmission:
    """`admit`'s decision with slots: buckets and concurrency slots together, all or
    nothing per item, exactly as deciding the items one by one in list order would.

    A tenant with at least as many free slots as items in the batch cannot run out within
    it: its items are decided with everyone else's in one bucket-table decision, and each
    admitted one takes a slot. A tenant with fewer (it is at its limit) has its items decided
    one by one, each only while a slot is free; tenants never share a bucket or a slot, so
    deciding them apart gives exactly the sequential answers. The caller holds its lock."""

    def __init__(self, leases: ConcurrencyLeases, limit_of: Callable[[str], int | None],
                 decide_buckets: DecideBuckets) -> None:
        self.leases = leases
        self._limit_of = limit_of
        self._decide_buckets = decide_buckets

    def admit(self, results: list[Any], asking: Asking, items: Sequence[AdmitItem], now: float) -> None:
        limits = {items[index].tenant: self._limit_of(items[index].tenant) for index, _ in asking}
        if all(limit is None for limit in limits.values()):  # no slots to take: the buckets alone
            self._decide_buckets(results, asking, now)
            return
        wanted = Counter(items[index].tenant for index, _ in asking)
        crowded = {tenant for tenant, limit in limits.items()
                   if limit is not None and wanted[tenant] > self.leases.free(tenant, limit, now)}
        together = [(index, ask) for index, ask in asking if items[index].tenant not in crowded]
        self._decide_buckets(results, together, now)
        for index, _ in together:
            self._lease(results[index], items[index], limits[items[index].tenant], now)
        for index, ask in asking:
            limit = limits[items[index].tenant]
            if items[index].tenant in crowded and limit is not None:
                self._admit_crowded(results, index, ask, items[index], limit, now)

    def _admit_crowded(self, results: list[Any], index: int, ask: Any, item: AdmitItem, limit: int,
                       now: float) -> None:
        if self.leases.free(item.tenant, limit, now) > 0:
            self._decide_buckets(results, [(index, ask)], now)
            self._lease(results[index], item, limit, now)
            return
        # No slot: refused. The buckets are asked without charging, for their own verdict.
        self._decide_buckets(results, [(index, dataclasses.replace(ask, dry_run=True))], now)
        verdict = results[index]
        if isinstance(verdict, ItemError):
            return
        wait = self.leases.retry_after(item.tenant, now)
        self.leases.refusal(item.tenant)  # with a shared store: more slots asked for at its next renewal
        verdict.admitted = False
        verdict.over.append(OverLimit(concurrency_limit_name(item.tenant), wait))
        if verdict.retry_after_s >= 0:  # -1: the cost can never fit, which says more
            verdict.retry_after_s = max(verdict.retry_after_s, wait)

    def _lease(self, verdict: AdmitVerdict | ItemError, item: AdmitItem, limit: int | None, now: float) -> None:
        """An admitted item of a tenant with a concurrency limit takes its slot (not a dry run)."""
        if limit is not None and not item.dry_run and isinstance(verdict, AdmitVerdict) and verdict.admitted:
            verdict.lease_id = self.leases.take(item.tenant, now, item.lease_ttl_s)
