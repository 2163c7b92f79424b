"""The rate limiter as its callers see it, wherever it runs: `RateLimit`, and how each of its
operations crosses the wire."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from services.common.proto_fields import FieldCodec
from services.pipeline.batch_rpc import BatchRpc, ItemError, decode_answer, encode_answer
from services.pipeline.interface import NO_OPTIONS, CallOptions, Interface, Metadata, UnaryRpc, message
from services.ratelimit.admission import ADMIT_BATCH, AdmitItem, AdmitVerdict
from wire.v1 import ratelimit_pb2


@dataclass(slots=True)  # not frozen: see services.pipeline.batch_rpc
class ReleaseItem:
    """A request's end as the limiter hears it (the fields of `spine.v1.ReleaseRequest`): the
    concurrency slot it held (0: none), and, where the model counted what it really used (an
    upstream's usage), what to settle against what it was charged."""

    lease_id: int = 0
    tenant: str = ""
    model: str = ""
    tokens_charged: int = 0
    tokens_used: int = 0
    # Who pays, what the answer used (priced by the spend ledger), the key's tokens per minute as admitted.
    key: str = ""
    team: str = ""
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    key_tokens_per_minute: float = 0.0


class RateLimit(Protocol):
    """Admission against a tenant's limits, and what a migration's split needs of it."""

    def admit(self, items: Sequence[AdmitItem], options: CallOptions = NO_OPTIONS) -> list[AdmitVerdict | ItemError]:
        """Decided as one by one in list order would be: a verdict per item (INVALID_ARGUMENT
        for a malformed one, RESOURCE_EXHAUSTED when a bucket has no room)."""
        ...

    def release(self, items: Sequence[ReleaseItem], options: CallOptions = NO_OPTIONS) -> list[bool | ItemError]:
        """Each slot given back (False: not held here any more) and each request's tokens settled."""
        ...

    def set_share(self, fraction: float, options: CallOptions = NO_OPTIONS) -> float:
        """Enforce `fraction` (0, 1] of every limit (a side of a split); the fraction enforced."""
        ...

    def should_rate_limit(self, request: ratelimit_pb2.RateLimitRequest,
                          options: CallOptions = NO_OPTIONS) -> ratelimit_pb2.RateLimitResponse:
        """The descriptor form of admission (what Envoy's rate limit filter asks)."""
        ...


_RELEASE = FieldCodec(ReleaseItem, ratelimit_pb2.ReleaseRequest)


def _encode_releases(items: Sequence[ReleaseItem]) -> ratelimit_pb2.ReleaseBatchRequest:
    return ratelimit_pb2.ReleaseBatchRequest(items=[_RELEASE.to_message(item) for item in items])


def _decode_releases(request: ratelimit_pb2.ReleaseBatchRequest) -> list[ReleaseItem]:
    return [_RELEASE.from_message(item) for item in request.items]


def _fill_released(response: ratelimit_pb2.ReleaseResponse, released: bool) -> None:
    response.released = released


RELEASE_BATCH: BatchRpc[ReleaseItem, bool, ratelimit_pb2.ReleaseBatchRequest, ratelimit_pb2.ReleaseBatchResponse] = BatchRpc(
    rpc="ReleaseBatch", method="release", encode_items=_encode_releases, decode_items=_decode_releases,
    encode_results=lambda results: encode_answer(ratelimit_pb2.ReleaseBatchResponse(), results, _fill_released),
    decode_results=lambda answer: decode_answer(answer, lambda response: response.released))


def _share_request(fraction: float) -> ratelimit_pb2.SetShareRequest:
    return ratelimit_pb2.SetShareRequest(fraction=fraction)


def _share_answer(response: ratelimit_pb2.SetShareResponse, trailing: Metadata) -> float:
    return float(response.fraction)


SET_SHARE: UnaryRpc[float, float] = UnaryRpc("SetShare", "set_share", _share_request, _share_answer)
SHOULD_RATE_LIMIT = message("ShouldRateLimit", "should_rate_limit")

RATELIMIT: Interface[RateLimit] = Interface("ratelimit", [ADMIT_BATCH, RELEASE_BATCH, SET_SHARE, SHOULD_RATE_LIMIT])
