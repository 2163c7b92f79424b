"""The `ratelimit:` config section: bucket limits per tenant, concurrency, the shared lease store.

A light module (pydantic, no torch): loading or checking a config, or printing its schema,
imports only this; defaults are documented in `runtime/default_config.yaml`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    model_validator,
)

from services.common.config_section import Float, NonEmptyStr, Section, Table, problem
from services.common.prometheus_http import ListenAddress
from services.common.redis_link import RedisLink
from services.ratelimit.spend_config import SpendConfig

# A rate of 0 never refills: that is a quota, which this service does not implement.
Rate = Annotated[Float, Field(gt=0)]
Burst = Annotated[Float, Field(ge=1)]


class BucketLimits(Section):
    """One tenant's limits: token buckets for requests per second and tokens per minute, each
    with a burst, and how many of its requests may be in flight at once (None: unlimited)."""

    requests_per_second: Rate = 200.0
    burst: Burst = 400.0
    tokens_per_minute: Rate = 6_000_000.0
    token_burst: Burst = 1_000_000.0
    # Counted from admission to the answer's last byte (streams included); past it
    # RESOURCE_EXHAUSTED with retry-after. Under a traffic split each rate limiter holds its
    # share of it (at least 1), like the buckets.
    max_concurrent_requests: Annotated[StrictInt, Field(ge=1)] | None = None
    # The tenant's share of the model's admissions within a priority class while other
    # tenants wait there too (services.inference.fair_share, read through
    # services.common.tenant_shares): 2 is admitted twice as often as 1.
    share_weight: Annotated[Float, Field(gt=0)] = 1.0

    def bucket(self, resource: str) -> tuple[float, float]:
        """(rate per second, capacity) of the bucket for `resource`."""
        if resource == "requests":
            return self.requests_per_second, self.burst
        return self.tokens_per_minute / 60.0, self.token_burst


class ConcurrencyWhenBusy(Section):
    """`ratelimit.concurrency_when_busy`: halve every `max_concurrent_requests` while the
    device is busy (the busy fraction the gateway last saw in the model's load hints), with
    hysteresis: halved once the figure is above `above`, whole again once it is below `below`."""

    halve: StrictBool = False
    above: Annotated[Float, Field(gt=0, le=1)] = 0.9
    below: Annotated[Float, Field(ge=0, lt=1)] = 0.8

    @model_validator(mode="after")
    def _below_is_below_above(self) -> ConcurrencyWhenBusy:
        if self.below >= self.above:
            raise problem(f"must be below `above` ({self.above:g}) for hysteresis, got {self.below:g}", "below")
        return self


class RedisStore(RedisLink):
    """`ratelimit.store.redis`: where the shared lease store is. `address` is HOST:PORT or
    unix:/PATH; every key starts with `key_prefix` (one Redis, or one hash slot: the lease
    scripts touch several keys at once). The password, when there is one, is read from a file,
    so it is never in a config or a log. A call slower than `timeout_s` counts as a failure:
    a slow store must not hold leases back. Spend (`spend`) is kept here too, under
    `<key_prefix>spend:`."""

    key_prefix: NonEmptyStr = "spine:ratelimit:"


class RateLimitStore(Section):
    """`ratelimit.store`: limits that hold across replicas (`services.ratelimit.leases`).

    Every replica keeps deciding on its own buckets; it leases tokens and concurrency slots
    from the store every `renew_interval_s`, sized to `lease_s` of its recent demand."""

    redis: RedisStore
    lease_s: Annotated[Float, Field(gt=0)] = 1.0
    renew_interval_s: Annotated[Float, Field(gt=0)] = 0.25
    # The fraction of each burst an idle bucket may spend before its next renewal, charged to
    # the store then (so a lone request is not refused for want of a lease).
    reserve: Annotated[Float, Field(ge=0, le=1)] = 0.05
    # How long a replica's concurrency slots outlive its last renewal (a SIGKILLed replica's
    # slots come back after this).
    slot_ttl_s: Annotated[Float, Field(gt=0)] = 3.0
    # While the store cannot be reached: `shares` decides on the last shares (the
    # controller's, at most 1/replicas last seen), `closed` on what is leased already, `open`
    # on the whole configured limit.
    fail_mode: Literal["shares", "closed", "open"] = "shares"
    # A rate limiter in a process of its own (the layered layout) serves these families at
    # /metrics here (`runtime.observability.store_metrics`); in the spine they are on its /metrics.
    metrics_listen: ListenAddress = "127.0.0.1:0"

    @model_validator(mode="after")
    def _renewed_within_a_lease(self) -> RateLimitStore:
        if self.renew_interval_s >= self.lease_s:
            raise problem(f"must be below lease_s ({self.lease_s:g}): a lease is renewed before it runs out, "
                          f"got {self.renew_interval_s:g}", "renew_interval_s")
        if self.slot_ttl_s <= self.renew_interval_s:
            raise problem(f"must be above renew_interval_s ({self.renew_interval_s:g}), got {self.slot_ttl_s:g}",
                          "slot_ttl_s")
        return self


class RateLimitConfig(Section):
    """The `ratelimit` section; a tenant's block inherits every key it leaves out from `default`."""

    where = "ratelimit"

    domain: NonEmptyStr = "spine"
    default: BucketLimits = BucketLimits()
    tenants: Table[BucketLimits] = Field(default_factory=dict)
    concurrency_when_busy: ConcurrencyWhenBusy = ConcurrencyWhenBusy()
    # Without it, each limiter holds its fixed share (`migration.limit_shares`).
    store: RateLimitStore | None = None
    # Prices, budgets and where spend is kept (`services.ratelimit.spend`).
    spend: SpendConfig = SpendConfig()

    @model_validator(mode="before")
    @classmethod
    def _tenants_inherit_default(cls, data: Any) -> Any:
        if not isinstance(data, Mapping) or not isinstance(data.get("tenants"), Mapping):
            return data
        default = data.get("default") or {}
        try:  # a bad default is reported once, at `default`, not again under every tenant
            BucketLimits.model_validate(default)
        except ValidationError:
            return data
        tenants = {name: {**default, **(block or {})} if isinstance(block, Mapping | None) else block
                   for name, block in data["tenants"].items()}
        return {**data, "tenants": tenants}

    def limits_for(self, tenant: str) -> BucketLimits:
        return self.tenants.get(tenant, self.default)
