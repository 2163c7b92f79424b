"""The config sections of the ratelimit, router, cache, metrics and logs middlewares.

Each is the component's config class (re-exported by its service module, so
`services.cache.CacheConfig` still works) and a section of the root model
(`spine.runtime.config_model`). They live here, not beside their services, because those
import torch: loading or checking a config, or printing its schema, should not.
Defaults are the ones the services have always had; `spine/default_config.yaml` documents them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from services.config_model import Float, Items, NonEmptyStr, Section, Table, problem
from services.prometheus_http import ListenAddress, is_loopback, parse_listen

# --- ratelimit ----------------------------------------------------------------------------

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

    @classmethod
    def from_dict(cls, cfg: Any, where: str, base: BucketLimits | None = None) -> BucketLimits:
        """Parse a limits block; keys not given come from `base` (the default block)."""
        if base is not None and isinstance(cfg, Mapping):
            cfg = {**base.model_dump(), **cfg}
        return cls.parse(cfg, where)

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


class RedisStore(Section):
    """`ratelimit.store.redis`: where the shared lease store is. `address` is HOST:PORT or
    unix:/PATH; every key starts with `key_prefix` (one Redis, or one hash slot: the lease
    scripts touch several keys at once). The password, when there is one, is read from a file,
    so it is never in a config or a log."""

    address: NonEmptyStr
    key_prefix: NonEmptyStr = "spine:ratelimit:"
    password_file: Path | None = None
    # A call slower than this counts as a failure: a slow store must not hold leases back.
    timeout_s: Annotated[Float, Field(gt=0)] = 0.25


class RateLimitStore(Section):
    """`ratelimit.store`: limits that hold across replicas (`services.ratelimit_leases`).

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
    # /metrics here (`spine.runtime.store_metrics`); in the spine they are on its /metrics.
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

    domain: NonEmptyStr = "spine"
    default: BucketLimits = BucketLimits()
    tenants: Table[BucketLimits] = Field(default_factory=dict)
    concurrency_when_busy: ConcurrencyWhenBusy = ConcurrencyWhenBusy()
    # Without it, each limiter holds its fixed share (`migration.limits`).
    store: RateLimitStore | None = None

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

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | None) -> RateLimitConfig:
        return cls.parse(section, "ratelimit")

    def limits_for(self, tenant: str) -> BucketLimits:
        return self.tenants.get(tenant, self.default)


# --- router -------------------------------------------------------------------------------


class ModelRoute(Section):
    """A model the router knows: its id, the backend serving it, other names for it, and the
    smaller model (an id or alias) a client may use while this one is overloaded."""

    id: NonEmptyStr
    backend: NonEmptyStr
    aliases: Items[NonEmptyStr] = ()
    fallback: NonEmptyStr | None = None


class RouterConfig(Section):
    """The `router` section. Every id and alias names exactly one model: a repeat is an error,
    never a silent "last one wins"."""

    # Not `min_length`: pydantic would also call a list whose only model is wrong "too short".
    models: Annotated[tuple[ModelRoute, ...], Field(json_schema_extra={"minItems": 1})]

    @field_validator("models")
    @classmethod
    def _names_are_unique(cls, models: tuple[ModelRoute, ...]) -> tuple[ModelRoute, ...]:
        if not models:
            raise problem("expected a non-empty list of models")
        owner: dict[str, str] = {}  # name -> the field that first claimed it
        for i, model in enumerate(models):
            if model.id in owner:
                raise problem(f"{model.id!r} is already used by {owner[model.id]}", i, "id")
            owner[model.id] = f"router.models[{i}].id"
        for i, model in enumerate(models):
            for j, alias in enumerate(model.aliases):
                if alias in owner:
                    raise problem(f"{alias!r} is already used by {owner[alias]}", i, "aliases", j)
                owner[alias] = f"router.models[{i}].aliases[{j}]"
        index = {name: i for i, model in enumerate(models) for name in (model.id, *model.aliases)}
        for i, model in enumerate(models):
            if model.fallback is None:
                continue
            if model.fallback not in index:
                raise problem(f"{model.fallback!r} is not a model id or alias; known: {', '.join(owner)}",
                              i, "fallback")
            if index[model.fallback] == i:
                raise problem(f"{model.fallback!r} names this model itself", i, "fallback")
        return models

    def fallback_ids(self) -> dict[str, str]:
        """Each model id with a fallback -> the id of that fallback (its alias resolved)."""
        names = {model.id: model.id for model in self.models}
        names.update({alias: model.id for model in self.models for alias in model.aliases})
        return {model.id: names[model.fallback] for model in self.models if model.fallback is not None}

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | None) -> RouterConfig:
        return cls.parse(section, "router")


# --- cache --------------------------------------------------------------------------------


class CacheConfig(Section):
    """The `cache` section: how many answers are kept, and for how long; and the table of
    pre-generated answers every cache process maps (`spine cache build`)."""

    max_entries: Annotated[StrictInt, Field(ge=1)] = 4096
    ttl_s: Annotated[Float, Field(gt=0)] = 300.0
    pregenerated: NonEmptyStr | None = None  # a table file's path (services.pregenerated)
    pregenerated_check_s: Annotated[Float, Field(gt=0)] = 1.0  # how often a lookup checks the file was replaced

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | None) -> CacheConfig:
        return cls.parse(section, "cache")


# --- metrics ------------------------------------------------------------------------------

# Prometheus-style buckets from 0.1 ms to 10 s: fine enough for an in-process middleware hop
# (tens of microseconds to a millisecond) and for a whole generation (seconds).
DEFAULT_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


class MetricsConfig(Section):
    """The `metrics` section. Loopback only unless `allow_external`: metrics name tenants."""

    http_listen: ListenAddress = "127.0.0.1:0"
    allow_external: StrictBool = False
    buckets: Annotated[tuple[Annotated[Float, Field(gt=0)], ...], Field(json_schema_extra={"minItems": 1})] = (
        DEFAULT_BUCKETS)
    initial_series: Annotated[StrictInt, Field(ge=1)] = 64


    @field_validator("buckets")
    @classmethod
    def _buckets_increase(cls, bounds: tuple[float, ...]) -> tuple[float, ...]:
        if not bounds:
            raise problem("expected a non-empty list of seconds")
        for i in range(1, len(bounds)):
            if bounds[i] <= bounds[i - 1]:
                raise problem(f"must be above {bounds[i - 1]}, got {bounds[i]}", i)
        return bounds

    @model_validator(mode="after")
    def _loopback_unless_allowed(self) -> MetricsConfig:
        host, _ = parse_listen(self.http_listen)
        if not self.allow_external and not is_loopback(host):
            raise problem(f"{self.http_listen!r} is not a loopback address; set metrics.allow_external: true "
                          "to expose metrics beyond this machine", "http_listen")
        return self

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any] | None) -> MetricsConfig:
        return cls.parse(cfg, "metrics")


# --- logs ---------------------------------------------------------------------------------


class LogsConfig(Section):
    """The `logs` section. `from_dict` resolves `path` against the run directory."""

    path: Path = Path("requests.jsonl")
    batch_lines: Annotated[StrictInt, Field(ge=1)] = 64
    flush_interval_s: Annotated[Float, Field(gt=0)] = 0.5
    ring_capacity: Annotated[StrictInt, Field(ge=1)] = 4096
    full_wait_s: Annotated[Float, Field(ge=0)] = 0.05
    max_line_bytes: Annotated[StrictInt, Field(ge=256)] = 65536
    fsync: StrictBool = True

    @field_validator("path", mode="before")
    @classmethod
    def _path_is_text(cls, value: Any) -> Any:
        if not isinstance(value, str | Path) or not str(value).strip():
            raise problem("expected a file path", show_input=True)
        return value

    @field_validator("ring_capacity")
    @classmethod
    def _ring_holds_a_batch(cls, capacity: int, info: ValidationInfo) -> int:
        batch = info.data.get("batch_lines")
        if batch is not None and capacity < batch:
            raise problem(f"must be >= logs.batch_lines ({batch})", show_input=True)
        return capacity

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any] | None, run_dir: str | Path) -> LogsConfig:
        config = cls.parse(cfg, "logs")
        return config.model_copy(update={"path": Path(run_dir) / config.path.expanduser()})
