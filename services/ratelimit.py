"""The RateLimit service: token buckets per (tenant, model, resource), Envoy-shaped.

The gateway sends one request per call with two descriptors, built by `ask_for`:
one request against the requests-per-second bucket and `prompt + max_tokens` tokens
against the tokens-per-minute bucket. A call is all-or-nothing: it is admitted only when
every descriptor fits, and then all of them are charged.

`admit_batch` decides a micro-batch with tensor ops and gives exactly the answers (and
leaves exactly the bucket levels) of deciding the same requests one by one in list order;
`admit_asks` is the same without protos (the spine's in-process path), and
`ShouldRateLimit` is the batch of one. See `services/token_buckets.py` for how.
"""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass
from typing import Any, cast

import grpc

from services.common import Clock, DeviceState
from services.sections import BucketLimits as BucketLimits
from services.sections import RateLimitConfig
from services.token_buckets import BatchDecision, BucketState, TokenBucketTable
from spine.v1 import ratelimit_pb2, ratelimit_pb2_grpc

Key = tuple[tuple[str, str], ...]
RESOURCES = ("requests", "tokens")
# Costs are summed exactly in float64; this bound keeps any batch's sums below 2**53.
MAX_HITS_ADDEND = 2**40
_OK = ratelimit_pb2.RateLimitResponse.OK
_OVER_LIMIT = ratelimit_pb2.RateLimitResponse.OVER_LIMIT
_NO_DECISION = BatchDecision(admitted=[], fits=[], remaining=[], retry_after_s=[], rounds=0)


class InvalidRateLimitRequest(ValueError):
    """A request the service cannot decide; the message names the field. `index` is its batch position."""

    def __init__(self, message: str, index: int = 0) -> None:
        super().__init__(message)
        self.index = index


@dataclass(frozen=True)
class RateLimitAsk:
    """A rate-limit request without protos: what the spine's batcher hands `admit_asks`.

    The same fields as `RateLimitRequest` (descriptors as (entries, hits) pairs), decided by
    the same code: `admit_batch` turns each proto into one of these first. In-process,
    building and reading back two descriptors of three entries per request (and a response
    with two statuses) cost more than the admission decision itself.
    """

    domain: str
    descriptors: tuple[tuple[Key, int], ...]
    dry_run: bool = False

    @classmethod
    def from_proto(cls, request: ratelimit_pb2.RateLimitRequest) -> RateLimitAsk:
        return cls(request.domain, tuple([(tuple([(e.key, e.value) for e in d.entries]), d.hits_addend)
                                          for d in request.descriptors]), request.dry_run)

    def to_proto(self) -> ratelimit_pb2.RateLimitRequest:
        Entry = ratelimit_pb2.RateLimitDescriptor.Entry
        return ratelimit_pb2.RateLimitRequest(domain=self.domain, dry_run=self.dry_run, descriptors=[
            ratelimit_pb2.RateLimitDescriptor(entries=[Entry(key=k, value=v) for k, v in key], hits_addend=hits)
            for key, hits in self.descriptors])


@dataclass(frozen=True)
class RateLimitVerdict:
    """`admit_asks`' answer: what a `RateLimitResponse` says, without the proto.

    `over` names each bucket the request did not fit, with its retry-after (-1: the cost
    is more than the bucket can ever hold); `retry_after_s` is the response's overall one.
    """

    admitted: bool
    over: tuple[tuple[str, float], ...]
    retry_after_s: float

    @classmethod
    def from_proto(cls, response: ratelimit_pb2.RateLimitResponse) -> RateLimitVerdict:
        return cls(response.overall_code != _OVER_LIMIT,
                   tuple([(s.limit_name, s.retry_after_s) for s in response.statuses if s.code == _OVER_LIMIT]),
                   response.retry_after_s)


@functools.lru_cache(maxsize=4096)
def _bucket_keys(tenant: str, model: str) -> tuple[Key, ...]:
    """Each resource's descriptor entries for a (tenant, model): made once, not per request."""
    return tuple((("tenant", tenant), ("model", model), ("resource", resource)) for resource in RESOURCES)


def ask_for(tenant: str, model: str, tokens: int, dry_run: bool = False, domain: str = "spine") -> RateLimitAsk:
    """What the gateway asks per request: one request, and `tokens` tokens."""
    requests_key, tokens_key = _bucket_keys(tenant, model)
    return RateLimitAsk(domain, ((requests_key, 1), (tokens_key, tokens)), dry_run)


def descriptors_for(tenant: str, model: str, tokens: int) -> list[ratelimit_pb2.RateLimitDescriptor]:
    """`ask_for`'s two descriptors as protos (what goes over the wire)."""
    return list(ask_for(tenant, model, tokens).to_proto().descriptors)


def _overall_retry(waits: list[float]) -> float:
    """A response's retry-after: -1 when some bucket can never fit it, else the longest wait."""
    return -1.0 if -1.0 in waits else max(waits)


def limit_name(key: Key) -> str:
    """`tenant=dev,model=tiny-lm,resource=tokens`: how a person names a bucket."""
    return ",".join(f"{k}={v}" for k, v in key)


@dataclass(frozen=True)
class _Bucket:
    """What a descriptor's entries resolve to: checked once per distinct key, then cached."""

    key: Key
    name: str
    limits: tuple[float, float]


@dataclass(frozen=True)
class _Row:
    bucket: _Bucket
    cost: float


class RateLimitService(ratelimit_pb2_grpc.RateLimitServicer):
    """Token-bucket admission; state lives in a `TokenBucketTable` on `device`."""

    def __init__(self, config: RateLimitConfig, device: DeviceState, clock: Clock = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._table = TokenBucketTable(device)
        self._lock = threading.Lock()
        self._buckets: dict[Key, _Bucket] = {}

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
        for i, row in enumerate(rows):
            retry = decision.retry_after_s[i]
            responses[row_request[i]].statuses.add(
                code=_OK if decision.fits[i] else _OVER_LIMIT,
                limit_name=row.bucket.name,
                limit_remaining=decision.remaining[i],
                retry_after_s=retry,
            )
            waits[row_request[i]].append(retry)
        for response, admitted, wait in zip(responses, decision.admitted, waits, strict=True):
            response.overall_code = _OK if admitted else _OVER_LIMIT
            response.retry_after_s = _overall_retry(wait)
        return responses

    def admit_asks(self, asks: list[RateLimitAsk], now: float | None = None) -> list[RateLimitVerdict]:
        """`admit_batch` without protos: the same decisions, buckets and errors."""
        rows, row_request, decision = self._decide(asks, now)
        over: list[list[tuple[str, float]]] = [[] for _ in asks]
        waits: list[list[float]] = [[] for _ in asks]
        for i, row in enumerate(rows):
            retry = decision.retry_after_s[i]
            if not decision.fits[i]:
                over[row_request[i]].append((row.bucket.name, retry))
            waits[row_request[i]].append(retry)
        return [RateLimitVerdict(bool(admitted), tuple(o), _overall_retry(w))
                for admitted, o, w in zip(decision.admitted, over, waits, strict=True)]

    def _decide(self, asks: list[RateLimitAsk], now: float | None) -> tuple[list[_Row], list[int], BatchDecision]:
        """Parse every ask (all or none), then ONE table decision in list order."""
        parsed = [self._parse(ask, index) for index, ask in enumerate(asks)]
        rows = [row for request_rows in parsed for row in request_rows]
        row_request = [index for index, request_rows in enumerate(parsed) for _ in request_rows]
        if not asks:
            return rows, row_request, _NO_DECISION
        with self._lock:
            at = self._clock() if now is None else now
            slots = self._table.slots([r.bucket.key for r in rows], [r.bucket.limits for r in rows], at)
            decision = self._table.decide(
                slots, [r.cost for r in rows], row_request, [not ask.dry_run for ask in asks], at
            )
        return rows, row_request, decision

    def validate(self, request: ratelimit_pb2.RateLimitRequest) -> None:
        """Raise InvalidRateLimitRequest when `request` cannot be decided."""
        self._parse(RateLimitAsk.from_proto(request), 0)

    def set_share(self, fraction: float) -> None:
        """Scale every limit to `fraction` (0 < fraction <= 1) of its configured value.

        When traffic is split between two layouts, each side enforces its share, so a
        tenant's total across both stays within its limit.
        """
        with self._lock:
            self._table.set_share(fraction)

    def bucket(self, key: Key) -> BucketState | None:
        """A bucket's state by its descriptor entries (for tests and `spine status`)."""
        with self._lock:
            return self._table.state(key)

    def snapshot(self) -> dict[str, BucketState]:
        """Every bucket by limit name."""
        with self._lock:
            return {limit_name(cast(Key, k)): v for k, v in self._table.snapshot().items()}

    # -- gRPC --------------------------------------------------------------------------
    def SetShare(self, request: ratelimit_pb2.SetShareRequest, context: Any) -> ratelimit_pb2.SetShareResponse:
        try:
            self.set_share(request.fraction)
        except ValueError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"fraction: {error}")
        return ratelimit_pb2.SetShareResponse(fraction=request.fraction)

    def ShouldRateLimit(self, request: ratelimit_pb2.RateLimitRequest, context: Any) -> ratelimit_pb2.RateLimitResponse:
        try:
            return self.admit_batch([request])[0]
        except InvalidRateLimitRequest as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except MemoryError as error:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"ratelimit: no room for a new bucket: {error}")
        raise AssertionError("context.abort returned")  # pragma: no cover

    # -- parsing -----------------------------------------------------------------------
    def _parse(self, ask: RateLimitAsk, index: int) -> list[_Row]:
        def invalid(message: str) -> InvalidRateLimitRequest:
            return InvalidRateLimitRequest(message, index)

        if ask.domain != self.config.domain:
            raise invalid(f"domain: expected {self.config.domain!r}, got {ask.domain!r}")
        if not ask.descriptors:
            raise invalid("descriptors: at least one descriptor is required")
        rows = []
        for d, (key, hits) in enumerate(ask.descriptors):
            bucket = self._buckets.get(key) or self._resolve(key, f"descriptors[{d}]", index)
            hits = hits or 1
            if hits < 0:  # a proto's uint64 cannot be; an ask built in-process can
                raise invalid(f"descriptors[{d}].hits_addend: must be >= 0, got {hits}")
            if hits > MAX_HITS_ADDEND:
                raise invalid(f"descriptors[{d}].hits_addend: at most {MAX_HITS_ADDEND}, got {hits}")
            rows.append(_Row(bucket, float(hits)))
        return rows

    def _resolve(self, key: Key, where: str, index: int) -> _Bucket:
        """Check a descriptor's entries once and remember which limits they name."""
        if not key:
            raise InvalidRateLimitRequest(f"{where}.entries: at least one entry is required", index)
        fields = dict(key)
        if len(fields) != len(key) or "" in fields:
            raise InvalidRateLimitRequest(
                f"{where}.entries: keys must be non-empty and distinct, got {limit_name(key)!r}", index
            )
        resource = fields.get("resource")
        if resource not in RESOURCES:
            raise InvalidRateLimitRequest(
                f"{where}.entries: needs resource= one of {', '.join(RESOURCES)}, got {resource!r}", index
            )
        bucket = _Bucket(key, limit_name(key), self.config.limits_for(fields.get("tenant", "")).bucket(resource))
        self._buckets[key] = bucket
        return bucket
