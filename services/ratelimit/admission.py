"""The rate limiter's admission on plain values, and `AdmitBatch` as its codec.

The pipeline's rate-limit step asks with `AdmitItem`s and reads `AdmitVerdict`s; in the
spine they go straight to `RateLimitService.admit`, across the wire through
`ADMIT_BATCH` (see `services.pipeline.batch_rpc`), so both layouts decide with the same
code and a verdict reads the same either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from services.common.proto_fields import FieldCodec
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
    tokens: int  # the prompt's tokens (bytes): settled with the real usage at the release
    dry_run: bool = False  # decide without consuming budget (shadow traffic)
    lease_ttl_s: float = 0.0  # how long a concurrency slot may be held (0: the default)
    busy: float = 0.0  # the device's busy fraction as the asker last saw it (0: unknown)
    # Who pays, and an API key's own limits and budget (zero values: none).
    key: str = ""
    team: str = ""
    key_requests_per_minute: float = 0.0
    key_tokens_per_minute: float = 0.0
    key_budget_usd: float = 0.0
    key_budget_window: str = ""

    @property
    def key_limited(self) -> bool:
        """The key has limits of its own, beside its tenant's."""
        return bool(self.key and (self.key_requests_per_minute or self.key_tokens_per_minute))


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
    budget_remaining_usd: float = -1.0  # the least remaining of the budgets that apply (-1: none)
    budget: str = ""  # refused for this budget
    budget_resets_in_s: float = 0.0


_ADMIT = FieldCodec(AdmitItem, ratelimit_pb2.AdmitRequest)


def _encode_items(items: Sequence[AdmitItem]) -> ratelimit_pb2.AdmitBatchRequest:
    return ratelimit_pb2.AdmitBatchRequest(items=[_ADMIT.to_message(item) for item in items])


def _decode_items(request: ratelimit_pb2.AdmitBatchRequest) -> list[AdmitItem]:
    return [_ADMIT.from_message(item) for item in request.items]


def _fill_verdict(response: ratelimit_pb2.AdmitResponse, verdict: AdmitVerdict) -> None:
    response.admitted = verdict.admitted
    response.retry_after_s = verdict.retry_after_s
    response.lease_id = verdict.lease_id
    response.budget_remaining_usd = verdict.budget_remaining_usd
    response.budget = verdict.budget
    response.budget_resets_in_s = verdict.budget_resets_in_s
    for over in verdict.over:
        response.over.add(limit_name=over.limit_name, retry_after_s=over.retry_after_s)


def _read_verdict(response: ratelimit_pb2.AdmitResponse) -> AdmitVerdict:
    return AdmitVerdict(admitted=response.admitted, retry_after_s=response.retry_after_s, lease_id=response.lease_id,
                        over=[OverLimit(over.limit_name, over.retry_after_s) for over in response.over],
                        budget_remaining_usd=response.budget_remaining_usd, budget=response.budget,
                        budget_resets_in_s=response.budget_resets_in_s)


ADMIT_BATCH: BatchRpc[AdmitItem, AdmitVerdict, ratelimit_pb2.AdmitBatchRequest, ratelimit_pb2.AdmitBatchResponse] = BatchRpc(
    rpc="AdmitBatch", method="admit", encode_items=_encode_items, decode_items=_decode_items,
    encode_results=lambda verdicts: encode_answer(ratelimit_pb2.AdmitBatchResponse(), verdicts, _fill_verdict),
    decode_results=lambda answer: decode_answer(answer, _read_verdict))
