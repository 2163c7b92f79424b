"""The root config model: every top-level section of a spine config, each a pydantic model.

`runtime.config.load_config` validates the merged YAML against `SpineConfig` before
anything starts, so a misspelled key anywhere, an unknown section or a bad value is refused
with its path (and, from a file, its line) instead of being found by a child process or
silently ignored. `spine config schema` prints its JSON schema.

The model's defaults are what a section gets when a key is absent from every file; they are
the components' own defaults, and `runtime/default_config.yaml` (merged under every config)
documents them. The model is built from the component table (`root_model`): each
component's section is its `ComponentSpec.config` model.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from pydantic import Field, ValidationError, create_model

from monolith.batched import BatchingConfig
from monolith.device_config import DeviceConfig
from runtime.http.config import HttpConfig
from runtime.sections import (
    EnvoyApiConfig,
    InternalConfig,
    ShadowConfig,
    TlsConfig,
    TracingConfig,
    calls_model,
    placements_model,
    remote_addresses_model,
)
from services.common.config_section import ConfigProblems, NonEmptyStr, Problem, Section, describe
from services.inference.output_policy import OutputPolicyConfig
from services.pipeline.limits import RequestLimits
from services.registry import DEFAULT, Registry


class _Root(Section):
    """A whole spine config (the default config with the user's file merged over it)."""


@functools.cache
def root_model(registry: Registry = DEFAULT) -> type[Section]:
    """The root model for a component table: the runtime's own sections, then one section
    per component (its `ComponentSpec.config` model), so a new middleware's section is
    checked like every other one."""
    fields: dict[str, Any] = {
        "listen": (NonEmptyStr, Field(default="127.0.0.1:50051", description="where the public Gateway API listens")),
        "placements": (placements_model(registry.names, registry.models, registry.foreign_protocols),
                       Field(default_factory=dict)),
        "limits": (RequestLimits, RequestLimits()),
        "output_policy": (OutputPolicyConfig, OutputPolicyConfig()),
        "batching": (BatchingConfig, BatchingConfig()),
        "calls": (calls_model(registry.names), Field(default_factory=dict)),
        "internal": (InternalConfig, InternalConfig()),
    }
    for spec in registry:
        model = spec.config_model()
        fields[spec.name] = (model, Field(default_factory=dict, validate_default=True))
    fields.update({
        "tracing": (TracingConfig, TracingConfig()),
        "shadow": (ShadowConfig, ShadowConfig()),
        "remote_addresses": (remote_addresses_model(registry.names), Field(default_factory=dict)),
        "envoy_api": (EnvoyApiConfig, EnvoyApiConfig()),
        "http": (HttpConfig, HttpConfig()),
        "tls": (TlsConfig | None, Field(default=None, description="TLS and mTLS on every TCP listener and link")),
        "device": (DeviceConfig, DeviceConfig()),
    })
    return create_model("SpineConfig", __base__=_Root, **fields)


SpineConfig = root_model(DEFAULT)
SECTIONS: frozenset[str] = frozenset(SpineConfig.model_fields)


def config_problems(config: Mapping[str, Any], registry: Registry = DEFAULT) -> list[Problem]:
    """Everything wrong with a whole config mapping, each with its path ([] when it is valid)."""
    model = root_model(registry)
    try:
        model.model_validate(config)
    except ValidationError as error:
        return describe(error, model)
    return []


def check_config(config: Mapping[str, Any], registry: Registry = DEFAULT) -> Section:
    """The validated model of a whole config mapping; ConfigProblems lists every problem."""
    problems = config_problems(config, registry)
    if problems:
        raise ConfigProblems([str(p) for p in problems])
    return root_model(registry).model_validate(config)


def json_schema() -> dict[str, Any]:
    """The JSON schema of a config file (`spine config schema`)."""
    return SpineConfig.model_json_schema()
