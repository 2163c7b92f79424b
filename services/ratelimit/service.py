"""The RateLimit service: token buckets per (tenant, model, resource).

The pipeline asks `AdmitBatch` (the per-request `Admit` is its batch of one): each item is
one request against the requests-per-second bucket and its prompt's tokens against the
tokens-per-minute bucket (settled with what it used at its release), turned into two
descriptors by `ask_for` (four with an API key's own limits). An item is all-or-nothing:
admitted only when every one fits, and then all are charged. With `ratelimit.spend`, budgets
are decided first and usage is charged at the release (`budget_admission`).
`ShouldRateLimit` is the general descriptor form (Envoy's shape), decided by the same
code on the same buckets (every ask's descriptors checked and resolved by `descriptors`).

A tenant with `max_concurrent_requests` also takes one of its concurrency slots with an
admitted item (the same all-or-nothing decision): the answer names the lease, which the
pipeline's `ReleaseStep` gives back at the request's last byte (`ReleaseBatch`), or which
expires at the request's deadline (`services/ratelimit/concurrency.py`).

A batch is decided with one table decision and gives exactly the answers (and leaves
exactly the bucket levels) of deciding the same requests one by one in list order. See
`services/ratelimit/batch_decisions.py` for how.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any, cast

import grpc

from services.common import Clock, DeviceState
from services.common.collectors import combined
from services.pipeline.batch_rpc import ItemError, StatusError
from services.pipeline.interface import NO_OPTIONS, CallOptions
from services.ratelimit.admission import ADMIT_BATCH, AdmitItem, AdmitVerdict, OverLimit
from services.ratelimit.admission import MAX_HITS_ADDEND as MAX_HITS_ADDEND
from services.ratelimit.admission import RESOURCES as RESOURCES
from services.ratelimit.api import RELEASE_BATCH, ReleaseItem
from services.ratelimit.asks import (
    InvalidRateLimitRequest,
    Key,
    RateLimitAsk,
    ask_for,
    bucket_keys,
    key_bucket,
    limit_name,
)
from services.ratelimit.budget_admission import admit_within_budgets, charge
from services.ratelimit.concurrency import ConcurrencyLeases, SlotAdmission
from services.ratelimit.config import BucketLimits as BucketLimits
from services.ratelimit.config import RateLimitConfig
from services.ratelimit.descriptors import Descriptors, Row
from services.ratelimit.leases import StoreLeases
from services.ratelimit.spend import SpendLedger
from services.ratelimit.token_buckets import BatchDecision, BucketState, TokenBucketTable
from wire.v1 import ratelimit_pb2, ratelimit_pb2_grpc

_OK = ratelimit_pb2.RateLimitResponse.OK
_OVER_LIMIT = ratelimit_pb2.RateLimitResponse.OVER_LIMIT
_NO_DECISION = BatchDecision(admitted=[], fits=[], remaining=[], retry_after_s=[], rounds=0)


def _overall_retry(waits: list[float]) -> float:
    """A response's retry-after: -1 when some bucket can never fit it, else the longest wait."""
    return -1.0 if -1.0 in waits else max(waits)


class RateLimitService(ratelimit_pb2_grpc.RateLimitServicer):
    """Token-bucket admission; state lives in a `TokenBucketTable` on `device`."""

    def __init__(self, config: RateLimitConfig, device: DeviceState, clock: Clock = time.monotonic,
                 spend: SpendLedger | None = None) -> None:
        self.config = config
        # Spend and budgets (`ratelimit.spend`, `services.ratelimit.spend`); None: not tracked.
        self.spend = spend
        self._clock = clock
        self._table = TokenBucketTable(device)
        self._lock = threading.Lock()
        self._descriptors = Descriptors(config, self._wake_store)
        busy = config.concurrency_when_busy
        self._leases = ConcurrencyLeases(busy.above, busy.below, busy.halve)
        self.alone_fast_path = True  # False: every item takes the general path (tests compare the two)
        concurrency_of = lambda tenant: config.limits_for(tenant).max_concurrent_requests  # noqa: E731
        self._slots = SlotAdmission(self._leases, concurrency_of, self._admit_into)
        # With `store`: limits held across replicas by leases (`services.ratelimit.leases`).
        self.store = None if config.store is None else StoreLeases(
            config.store, self._table, self._leases, self._lock, lambda key: self._descriptors.limits(cast(Key, key)),
            concurrency_of, tuple(t for t, limits in config.tenants.items() if limits.max_concurrent_requests),
            clock).start()
        self.store_collector = combined(None if self.store is None else self.store.collector(),
                                        None if spend is None else spend.collector())
        self.local_health = None if self.store is None else self.store.health

    def _wake_store(self) -> None:
        if self.store is not None:
            self.store.wake()

    def close(self) -> None:
        """Give the store's leases back and send the last charges (nothing to do without either)."""
        if self.store is not None:
            self.store.close()
        if self.spend is not None:
            self.spend.close()

    # -- plain Python API (the spine's batcher calls this) ----------------------------
    def admit_batch(
        self, requests: list[ratelimit_pb2.RateLimitRequest], now: float | None = None
    ) -> list[ratelimit_pb2.RateLimitResponse]:
        """Decide `requests` as if one by one in list order, all at time `now` (default: clock).

        Raises InvalidRateLimitRequest (naming the field and the request's index) before
        touching any bucket when any request is malformed; use `validate` to sift a batch.
        """
        asks = [RateLimitAsk.from_proto(request) for request in requests]
        rows, row_request, decision = self._decide(asks, now)
        responses = [ratelimit_pb2.RateLimitResponse() for _ in requests]
        waits: list[list[float]] = [[] for _ in requests]
        share = self._table.share
        for i, row in enumerate(rows):
            retry = decision.retry_after_s[i]
            rate, capacity = row.bucket.limits
            responses[row_request[i]].statuses.add(
                code=_OK if decision.fits[i] else _OVER_LIMIT,
                limit_name=row.bucket.name,
                limit_remaining=decision.remaining[i],
                retry_after_s=retry,
                capacity=capacity * share,
                refill_per_s=rate * share,
            )
            waits[row_request[i]].append(retry)
        for response, admitted, wait in zip(responses, decision.admitted, waits, strict=True):
            response.overall_code = _OK if admitted else _OVER_LIMIT
            response.retry_after_s = _overall_retry(wait)
        return responses

    def _decide(self, asks: list[RateLimitAsk], now: float | None) -> tuple[list[Row], list[int], BatchDecision]:
        """Parse every ask (all or none), then ONE table decision in list order."""
        with self._lock:
            return self._decide_locked(asks, self._clock() if now is None else now)

    def _decide_locked(self, asks: list[RateLimitAsk], now: float) -> tuple[list[Row], list[int], BatchDecision]:
        parsed = [self._descriptors.rows(ask, index) for index, ask in enumerate(asks)]
        rows = [row for request_rows in parsed for row in request_rows]
        row_request = [index for index, request_rows in enumerate(parsed) for _ in request_rows]
        if not asks:
            return rows, row_request, _NO_DECISION
        slots = self._table.slots([r.bucket.key for r in rows], [r.bucket.limits for r in rows], now)
        decision = self._table.decide(slots, [r.cost for r in rows], row_request, [not ask.dry_run for ask in asks],
                                      now)
        if self.store is not None and self.store.idle:
            self.store.first_use([r.bucket.key for r in rows])
        return rows, row_request, decision

    def validate(self, request: ratelimit_pb2.RateLimitRequest) -> None:
        """Raise InvalidRateLimitRequest when `request` cannot be decided."""
        self._descriptors.rows(RateLimitAsk.from_proto(request), 0)

    def set_share(self, fraction: float, options: CallOptions = NO_OPTIONS) -> float:
        """Scale every limit to `fraction` (0 < fraction <= 1) of its configured value; the
        fraction enforced (ValueError outside that range).

        When traffic is split between two layouts, each side enforces its share, so a
        tenant's total across both stays within its limit.
        """
        with self._lock:
            if self.store is not None:  # the share is the store's fallback (leases decide)
                self.store.set_share(float(fraction))
                return float(fraction)
            self._table.set_share(fraction)
            self._leases.set_share(float(fraction))
        return float(fraction)

    def bucket(self, key: Key) -> BucketState | None:
        """A bucket's state by its descriptor entries (for tests and `spine status`)."""
        with self._lock:
            return self._table.state(key)

    def snapshot(self) -> dict[str, BucketState]:
        """Every bucket by limit name."""
        with self._lock:
            return {limit_name(cast(Key, k)): v for k, v in self._table.snapshot().items()}

    def in_flight(self) -> dict[str, int]:
        """Concurrency slots held now, by tenant (expired leases dropped)."""
        with self._lock:
            now = self._clock()
            for tenant in list(self._leases.in_flight()):
                self._leases.held(tenant, now)
            return self._leases.in_flight()

    def concurrency_limit(self, tenant: str) -> int | None:
        """The concurrency limit enforced for `tenant` now (share and busy halving applied)."""
        configured = self.config.limits_for(tenant).max_concurrent_requests
        with self._lock:
            return None if configured is None else self._leases.limit(configured)

    # -- gRPC --------------------------------------------------------------------------
    def admit(self, items: Sequence[AdmitItem], options: CallOptions = NO_OPTIONS) -> list[AdmitVerdict | ItemError]:
        """Decide every item as if one by one in list order.

        A malformed item is refused alone (INVALID_ARGUMENT naming the field) and the rest
        decided without it; when the bucket table has no room for a new bucket, the items
        are decided one by one so only those that needed room fail (RESOURCE_EXHAUSTED).

        With `ratelimit.spend`, the budgets come first (`budget_admission`): an item that
        would pass one is refused and touches no bucket."""
        if self.spend is None:
            return self._admit_limits(items)
        return admit_within_budgets(self.spend, items, self._admit_limits)

    def _admit_limits(self, items: Sequence[AdmitItem]) -> list[AdmitVerdict | ItemError]:
        """`admit` on the buckets and slots alone."""
        if not self.alone_fast_path:
            return self._admit_together(items)
        # Item by item on their buckets while they can be (`_admit_alone`): in list order,
        # which is what the answers must equal, and cheaper than the general path below for
        # the few items a micro-batch brings: the general path's asks, rows and one table
        # decision only pay for themselves on larger batches than a host CPU's micro-batches
        # (timeit it against `_admit_together` before changing this). From the first item that
        # cannot be, the rest go through the general path, after those decided.
        decided: list[AdmitVerdict | ItemError] = []
        for index, item in enumerate(items):
            verdict = self._admit_alone(item)
            if verdict is None:
                return decided + self._admit_together(items[index:])
            decided.append(verdict)
        return decided

    def _admit_together(self, items: Sequence[AdmitItem]) -> list[AdmitVerdict | ItemError]:
        """The general path: every item with one table decision (slots, new buckets, bad items)."""
        results: list[Any] = [None] * len(items)
        asking: list[tuple[int, RateLimitAsk]] = []
        domain = self.config.domain
        for index, item in enumerate(items):
            if not item.tenant or not item.model:
                field_name = "tenant" if not item.tenant else "model"
                results[index] = ItemError(grpc.StatusCode.INVALID_ARGUMENT, f"{field_name}: must not be empty")
                continue
            asking.append((index, ask_for(item.tenant, item.model, item.tokens, item.dry_run, domain, item.key,
                                          item.key_requests_per_minute, item.key_tokens_per_minute)))
        with self._lock:
            now = self._clock()
            if asking:
                self._leases.observe_busy(max(items[index].busy for index, _ in asking))
            self._slots.admit(results, asking, items, now)
        return results

    def _admit_alone(self, item: AdmitItem) -> AdmitVerdict | None:
        """An item whose buckets exist and whose tenant has no concurrency limit, decided
        straight on its two buckets (`TokenBucketTable.decide_alone`: the general path's
        answer, without its asks, rows and per-request dicts — the rate limiter was the
        dearest step of a lone request); None: the general path decides it."""
        if (not item.tenant or not item.model or not 0 <= item.tokens <= MAX_HITS_ADDEND or item.key_limited
                or self.config.limits_for(item.tenant).max_concurrent_requests is not None):
            return None
        buckets = [self._descriptors.get(key) for key in bucket_keys(item.tenant, item.model)]
        with self._lock:
            slots = [slot for bucket in buckets if bucket is not None and (slot := self._table.slot_of(bucket.key)) is not None]
            if len(slots) != len(buckets):
                return None
            decision = self._table.decide_alone(slots, (1.0, float(item.tokens or 1)), not item.dry_run, self._clock())
            if decision is None:
                return None
            self._leases.observe_busy(item.busy)
            if self.store is not None and self.store.idle:
                self.store.first_use([bucket.key for bucket in buckets if bucket is not None])
        verdict = AdmitVerdict(admitted=decision.admitted[0], retry_after_s=_overall_retry(decision.retry_after_s))
        verdict.over = [OverLimit(bucket.name, retry) for bucket, fits, retry
                        in zip(buckets, decision.fits, decision.retry_after_s, strict=True) if bucket and not fits]
        return verdict

    def AdmitBatch(self, request: ratelimit_pb2.AdmitBatchRequest,
                   context: Any = None) -> ratelimit_pb2.AdmitBatchResponse:
        """`admit` over the wire."""
        return ADMIT_BATCH.serve(self, request, context)

    def release(self, items: Sequence[ReleaseItem], options: CallOptions = NO_OPTIONS) -> list[bool | ItemError]:
        """Give concurrency slots back; a lease not held here (released, expired, another
        limiter's) is answered False, not refused. Each request's tokens are settled with
        what it used, and its usage charged to its spend."""
        released: list[bool | ItemError] = []
        with self._lock:
            now = self._clock()
            for item in items:
                released.append(item.lease_id != 0 and self._leases.release(item.lease_id, now))
                if item.tokens_used and item.tenant and item.model:
                    extra = float(item.tokens_used) - float(item.tokens_charged)
                    self._settle(bucket_keys(item.tenant, item.model)[1], extra)
                    if item.key and item.key_tokens_per_minute:
                        self._settle(key_bucket(item.key, "tokens", item.key_tokens_per_minute), extra)
        if self.spend is not None:  # priced outside the lock: the ledger has its own
            charge(self.spend, items)
        return released

    def ReleaseBatch(self, request: ratelimit_pb2.ReleaseBatchRequest,
                     context: Any = None) -> ratelimit_pb2.ReleaseBatchResponse:
        """`release` over the wire."""
        return RELEASE_BATCH.serve(self, request, context)

    def _settle(self, key: Key, extra: float) -> None:
        """Charge a request's tokens beyond its admission's estimate (negative: give back what
        it did not use) to a tokens bucket; the level may go below zero, down to one burst, so
        a request that used more than it was charged delays the next ones. With a shared
        store, a settle that takes the level below zero wakes the renewal, which charges that
        to the store's bucket at once (`services.ratelimit.leases`), so every replica refuses
        next; any other settle waits for the next renewal (every request settles: waking on
        each would make the store's calls per request, not per renewal)."""
        if extra and self._table.slot_of(key) is not None:
            level = self._table.settle(key, extra)
            if self.store is not None and level < 0:
                self.store.wake()

    def _admit_into(self, results: list[Any], asking: list[tuple[int, RateLimitAsk]], now: float) -> None:
        asking = list(asking)
        while asking:
            try:
                self._fill(results, asking, self._decide_locked([ask for _, ask in asking], now))
                return
            except InvalidRateLimitRequest as error:  # raised before any bucket changed
                index, _ = asking.pop(error.index)
                results[index] = ItemError(grpc.StatusCode.INVALID_ARGUMENT, str(error))
            except MemoryError:
                break
        for index, ask in asking:  # no room for a new bucket: only the one that needs it fails
            try:
                self._fill(results, [(index, ask)], self._decide_locked([ask], now))
            except MemoryError as error:
                results[index] = ItemError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                           f"ratelimit: no room for a new bucket: {error}")

    @staticmethod
    def _fill(results: list[Any], asking: list[tuple[int, RateLimitAsk]],
              decided: tuple[list[Row], list[int], BatchDecision]) -> None:
        rows, row_request, decision = decided
        verdicts = [AdmitVerdict() for _ in asking]
        waits: list[list[float]] = [[] for _ in asking]
        for i, row in enumerate(rows):
            retry = decision.retry_after_s[i]
            if not decision.fits[i]:
                verdicts[row_request[i]].over.append(OverLimit(row.bucket.name, retry))
            waits[row_request[i]].append(retry)
        for (index, _), verdict, admitted, wait in zip(asking, verdicts, decision.admitted, waits, strict=True):
            verdict.admitted = bool(admitted)
            verdict.retry_after_s = _overall_retry(wait)
            results[index] = verdict

    def SetShare(self, request: ratelimit_pb2.SetShareRequest, context: Any) -> ratelimit_pb2.SetShareResponse:
        try:
            return ratelimit_pb2.SetShareResponse(fraction=self.set_share(request.fraction))
        except ValueError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"fraction: {error}")
        raise AssertionError("context.abort returned")  # pragma: no cover

    def should_rate_limit(self, request: ratelimit_pb2.RateLimitRequest,
                          options: CallOptions = NO_OPTIONS) -> ratelimit_pb2.RateLimitResponse:
        """The descriptor form (Envoy's): INVALID_ARGUMENT for a request it cannot decide,
        RESOURCE_EXHAUSTED when a bucket has no room (a `StatusError`, as the wire's)."""
        try:
            return self.admit_batch([request])[0]
        except InvalidRateLimitRequest as error:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from None
        except MemoryError as error:
            raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"ratelimit: no room for a new bucket: {error}") from None

    def ShouldRateLimit(self, request: ratelimit_pb2.RateLimitRequest, context: Any) -> ratelimit_pb2.RateLimitResponse:
        try:
            return self.should_rate_limit(request)
        except StatusError as error:
            context.abort(error.code(), error.details())
        raise AssertionError("context.abort returned")  # pragma: no cover
