"""The `metrics:` config section: the /metrics listen address and the latency buckets.

A light module (pydantic, no torch): loading or checking a config, or printing its schema,
imports only this; defaults are documented in `runtime/default_config.yaml`.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import (
    Field,
    StrictBool,
    StrictInt,
    field_validator,
    model_validator,
)

from services.common.config_section import Float, Section, problem
from services.common.prometheus_http import ListenAddress, is_loopback, parse_listen

# Prometheus-style buckets from 0.1 ms to 10 s: fine enough for an in-process middleware hop
# (tens of microseconds to a millisecond) and for a whole generation (seconds).
DEFAULT_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


class MetricsConfig(Section):
    """The `metrics` section. Loopback only unless `allow_external`: metrics name tenants."""

    where = "metrics"

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
