"""The root config model: every top-level section of a spine config, each a pydantic model.

`spine.runtime.config.load_config` validates the merged YAML against `SpineConfig` before
anything starts, so a misspelled key anywhere, an unknown section or a bad value is refused
with its path (and, from a file, its line) instead of being found by a child process or
silently ignored. `spine config schema` prints its JSON schema.

The model's defaults are what a section gets when a key is absent from every file; they are
the components' own defaults, and `spine/default_config.yaml` (merged under every config)
documents them. `limits` and `batching` are typed loosely for now: their parsers
(`services.pipeline.verdicts.RequestLimits`, `monolith.batched.BatchingConfig`) still check
them when a stack starts, before any child process.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field, ValidationError

from monolith.device_config import DeviceConfig
from services.auth import AuthSection
from services.config_model import ConfigProblems, NonEmptyStr, Problem, Section, Table, describe
from services.inference_config import InferenceConfig
from services.sections import (
    CacheConfig,
    LogsConfig,
    MetricsConfig,
    ModelRoute,
    RateLimitConfig,
    RouterConfig,
)
from spine.runtime.sections import Placements, RemoteAddresses, ShadowConfig, TracingConfig

# The built-in model behind the inference component, under the names clients use for it.
_BUILT_IN_ROUTE = ModelRoute(id="tiny-lm", backend="inference", aliases=("default", "tiny"))


class SpineConfig(Section):
    """A whole spine config (the default config with the user's file merged over it)."""

    listen: NonEmptyStr = Field(default="127.0.0.1:50051", description="where the public Gateway API listens")
    placements: Placements = Placements()
    limits: Table[Any] = Field(default_factory=dict, description="request validation (RequestLimits); "
                                                                 "checked when a stack starts")
    auth: AuthSection = AuthSection()
    ratelimit: RateLimitConfig = RateLimitConfig()
    router: RouterConfig = RouterConfig(models=(_BUILT_IN_ROUTE,))
    cache: CacheConfig = CacheConfig()
    metrics: MetricsConfig = MetricsConfig()
    logs: LogsConfig = LogsConfig()
    inference: InferenceConfig = InferenceConfig()
    batching: Table[Any] = Field(default_factory=dict, description="the spine's micro-batcher "
                                                                   "(BatchingConfig); checked when a stack starts")
    tracing: TracingConfig = TracingConfig()
    shadow: ShadowConfig = ShadowConfig()
    remote_addresses: RemoteAddresses = RemoteAddresses()
    device: DeviceConfig = DeviceConfig()


SECTIONS: frozenset[str] = frozenset(SpineConfig.model_fields)


def config_problems(config: Mapping[str, Any]) -> list[Problem]:
    """Everything wrong with a whole config mapping, each with its path ([] when it is valid)."""
    try:
        SpineConfig.model_validate(config)
    except ValidationError as error:
        return describe(error, SpineConfig)
    return []


def check_config(config: Mapping[str, Any]) -> SpineConfig:
    """The validated model of a whole config mapping; ConfigProblems lists every problem."""
    problems = config_problems(config)
    if problems:
        raise ConfigProblems([str(p) for p in problems])
    return SpineConfig.model_validate(config)


def json_schema() -> dict[str, Any]:
    """The JSON schema of a config file (`spine config schema`)."""
    return SpineConfig.model_json_schema()
