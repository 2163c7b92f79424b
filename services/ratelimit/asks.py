"""What the rate limiter decides, whichever rpc asked: a domain and (descriptor entries, hits) pairs.

`AdmitBatch` items (one request and its tokens: `ask_for`) and Envoy-shaped
`ShouldRateLimit` descriptors both become a `RateLimitAsk` first, so one parse and one
decision path serve both.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from services.ratelimit.admission import RESOURCES
from wire.v1 import ratelimit_pb2

Key = tuple[tuple[str, str], ...]


class InvalidRateLimitRequest(ValueError):
    """A request the service cannot decide; the message names the field. `index` is its batch position."""

    def __init__(self, message: str, index: int = 0) -> None:
        super().__init__(message)
        self.index = index


@dataclass(frozen=True)
class RateLimitAsk:
    """What is decided, whichever rpc asked: a domain and descriptors as (entries, hits) pairs.

    `AdmitBatch` items and `ShouldRateLimit` descriptors both become these first, so one
    parse and one decision path serve both.
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


@functools.lru_cache(maxsize=4096)
def bucket_keys(tenant: str, model: str) -> tuple[Key, ...]:
    """Each resource's descriptor entries for a (tenant, model): made once, not per request."""
    return tuple((("tenant", tenant), ("model", model), ("resource", resource)) for resource in RESOURCES)


def ask_for(tenant: str, model: str, tokens: int, dry_run: bool = False, domain: str = "spine",
            key: str = "", key_requests_per_minute: float = 0.0, key_tokens_per_minute: float = 0.0) -> RateLimitAsk:
    """What the gateway asks per request: one request, and `tokens` tokens; against the API
    key's own buckets too where it has limits of its own."""
    requests_key, tokens_key = bucket_keys(tenant, model)
    descriptors: tuple[tuple[Key, int], ...] = ((requests_key, 1), (tokens_key, tokens))
    if key and key_requests_per_minute:
        descriptors += ((key_bucket(key, "requests", key_requests_per_minute), 1),)
    if key and key_tokens_per_minute:
        descriptors += ((key_bucket(key, "tokens", key_tokens_per_minute), tokens),)
    return RateLimitAsk(domain, descriptors, dry_run)


def key_bucket(key: str, resource: str, per_minute: float) -> Key:
    """An API key's own bucket for `resource`: `per_minute` a minute, a minute's worth of burst.
    The limit is part of the name, so a key whose limit changes starts a bucket of the new size."""
    return (("key", key), ("resource", resource), ("per_minute", f"{per_minute:g}"))


def key_limits(key: Key) -> tuple[float, float] | None:
    """(rate per second, burst) of a `key_bucket`, None for any other descriptor."""
    fields = dict(key)
    if "key" not in fields or "per_minute" not in fields:
        return None
    try:
        per_minute = float(fields["per_minute"])
    except ValueError:
        return None
    return (per_minute / 60.0, max(per_minute, 1.0)) if per_minute > 0 else None


def descriptors_for(tenant: str, model: str, tokens: int) -> list[ratelimit_pb2.RateLimitDescriptor]:
    """`ask_for`'s two descriptors as protos (what goes over the wire)."""
    return list(ask_for(tenant, model, tokens).to_proto().descriptors)


def limit_name(key: Key) -> str:
    """`tenant=dev,model=tiny-lm,resource=tokens`: how a person names a bucket."""
    return ",".join(f"{k}={v}" for k, v in key)
