"""An ask's descriptors checked and resolved to the buckets they name, once per distinct key.

Every rpc's ask (`services.ratelimit.asks.RateLimitAsk`) is parsed here before any bucket
moves: the domain, each descriptor's entries (non-empty, distinct keys, a known resource) and
hits. A descriptor's entries are checked the first time they are seen and remembered with the
limits they name (an API key's own, or its tenant's for the resource), so the hot path looks a
known bucket up instead of checking it again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.ratelimit.admission import MAX_HITS_ADDEND, RESOURCES
from services.ratelimit.asks import InvalidRateLimitRequest, Key, RateLimitAsk, key_limits, limit_name
from services.ratelimit.config import RateLimitConfig


@dataclass(frozen=True)
class Bucket:
    """What a descriptor's entries resolve to: checked once per distinct key, then cached."""

    key: Key
    name: str
    limits: tuple[float, float]  # (rate per second, burst)


@dataclass(frozen=True)
class Row:
    """One descriptor of an ask: its bucket and what it costs."""

    bucket: Bucket
    cost: float


class Descriptors:
    """The buckets every descriptor seen so far names; callers hold the limiter's lock."""

    def __init__(self, config: RateLimitConfig, on_new_bucket: Callable[[], None]) -> None:
        self._config = config
        self._on_new_bucket = on_new_bucket  # a new bucket wakes the store's renewal
        self._buckets: dict[Key, Bucket] = {}

    def get(self, key: Key) -> Bucket | None:
        """The bucket `key` names, None where it has not been resolved yet."""
        return self._buckets.get(key)

    def limits(self, key: Key) -> tuple[float, float]:
        """A resolved bucket's (rate, burst)."""
        return self._buckets[key].limits

    def rows(self, ask: RateLimitAsk, index: int) -> list[Row]:
        """`ask`'s descriptors as rows, or InvalidRateLimitRequest naming the field and `index`."""
        def invalid(message: str) -> InvalidRateLimitRequest:
            return InvalidRateLimitRequest(message, index)

        if ask.domain != self._config.domain:
            raise invalid(f"domain: expected {self._config.domain!r}, got {ask.domain!r}")
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
            rows.append(Row(bucket, float(hits)))
        return rows

    def _resolve(self, key: Key, where: str, index: int) -> Bucket:
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
        limits = key_limits(key) or self._config.limits_for(fields.get("tenant", "")).bucket(resource)
        bucket = Bucket(key, limit_name(key), limits)
        self._buckets[key] = bucket
        self._on_new_bucket()
        return bucket
