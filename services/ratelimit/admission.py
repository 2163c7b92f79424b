"""The rate limiter's admission on plain values, and `AdmitBatch` as its codec.

The pipeline's rate-limit stage asks with `AdmitItem`s and reads `AdmitVerdict`s; in the
spine they go straight to `RateLimitService.admit_items`, across the wire through
`ADMIT_BATCH` (see `services.pipeline.batch_rpc`), so both layouts decide with the same
code and a verdict reads the same either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from services.pipeline.batch_rpc import BatchRpc, decode_answer, encode_answer
from wire.v1 import ratelimit_pb2

# What a bucket counts, one bucket per resource for each (tenant, model).
RESOURCES = ("requests", "tokens")
# Costs are summed exactly in float64; this bound keeps any batch's sums below 2**53.
MAX_HITS_ADDEND = 2**40


@dataclass(slots=True)  # not frozen: see services.pipeline.batch_rpc
class AdmitItem:
    """One request to admit (the fields of `spine.v1.AdmitRequest`)."""

    tenant: str
    model: str  # the resolved model id
    tokens: int  # prompt bytes plus max_tokens
    dry_run: bool = False  # decide without consuming budget (shadow traffic)
    lease_ttl_s: float = 0.0  # how long a concurrency slot may be held (0: the default)
    busy: float = 0.0  # the device's busy fraction as the asker last saw it (0: unknown)


@dataclass(frozen=True, slots=True)
class OverLimit:
    """A limit the request did not fit: its name, and when it would (-1: never)."""

    limit_name: str
    retry_after_s: float


@dataclass(slots=True)
class AdmitVerdict:
    """The answer for one item (the fields of `spine.v1.AdmitResponse`)."""

    admitted: bool = False
    retry_after_s: float = 0.0
    over: list[OverLimit] = field(default_factory=list)
    lease_id: int = 0  # the concurrency slot the request holds (0: none)


def _encode_items(items: Sequence[AdmitItem]) -> ratelimit_pb2.AdmitBatchRequest:
    request = ratelimit_pb2.AdmitBatchRequest()
    for item in items:
        request.items.add(tenant=item.tenant, model=item.model, tokens=item.tokens, dry_run=item.dry_run,
                          lease_ttl_s=item.lease_ttl_s, busy=item.busy)
    return request


def _decode_items(request: ratelimit_pb2.AdmitBatchRequest) -> list[AdmitItem]:
    return [AdmitItem(item.tenant, item.model, item.tokens, item.dry_run, item.lease_ttl_s, item.busy)
            for item in request.items]


def _fill_verdict(response: ratelimit_pb2.AdmitResponse, verdict: AdmitVerdict) -> None:
    response.admitted = verdict.admitted
    response.retry_after_s = verdict.retry_after_s
    response.lease_id = verdict.lease_id
    for over in verdict.over:
        response.over.add(limit_name=over.limit_name, retry_after_s=over.retry_after_s)


def _read_verdict(response: ratelimit_pb2.AdmitResponse) -> AdmitVerdict:
    return AdmitVerdict(admitted=response.admitted, retry_after_s=response.retry_after_s, lease_id=response.lease_id,
                        over=[OverLimit(over.limit_name, over.retry_after_s) for over in response.over])


ADMIT_BATCH: BatchRpc[AdmitItem, AdmitVerdict] = BatchRpc(
    rpc="AdmitBatch", method="admit", encode_items=_encode_items, decode_items=_decode_items,
    encode_results=lambda verdicts: encode_answer(ratelimit_pb2.AdmitBatchResponse(), verdicts, _fill_verdict),
    decode_results=lambda answer: decode_answer(answer, _read_verdict))
