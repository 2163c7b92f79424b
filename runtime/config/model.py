"""The whole spine config, typed once: `SpineConfig`, what `load_config` returns.

Every section is a pydantic model (`services.common.config_section.Section`: unknown keys
refused, immutable once loaded), and each model's field defaults are the documented defaults —
the one place they live (`runtime/default_config.yaml` spells them out for a reader; a test
holds the two equal). The components' sections come from the component table's side
(`services.component.ComponentConfig`); this module adds the runtime's own. `spine config
schema` prints its JSON schema.

A config remembers the data it was read from (`written`): a process that derives another
config from it (`with_overrides`) or hands one to a child (`to_yaml`) starts from what was
written, not from every default spelled out, so a key the file left out keeps meaning
"the default" — e.g. a served model block of `inference.models` still inherits the section's
serving controls.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import yaml
from pydantic import BaseModel, Field, PrivateAttr, SecretStr, ValidationError, create_model, model_validator

from monolith.batched_pipeline import BatchingConfig
from monolith.device_config import DeviceConfig
from runtime.config.http import HttpConfig
from runtime.config.sections import (
    CallsBase,
    EnvoyApiConfig,
    InternalConfig,
    PlacementsBase,
    RemoteAddressesBase,
    ShadowConfig,
    TlsConfig,
    TracingConfig,
    calls_model,
    placements_model,
    remote_addresses_model,
)
from services.common.config_section import ConfigProblems, NonEmptyStr, Section, describe, problem
from services.component import ComponentConfig
from services.inference.output_policy import OutputPolicyConfig
from services.pipeline.limits import RequestLimits
from services.registry import DEFAULT, Registry

if TYPE_CHECKING:  # built from the component table; code reads them through their base classes
    Placements = PlacementsBase
    CallsConfig = CallsBase
    RemoteAddresses = RemoteAddressesBase
else:
    Placements = placements_model(DEFAULT.placement_fields)
    CallsConfig = calls_model(DEFAULT.names)
    RemoteAddresses = remote_addresses_model(DEFAULT.names)


class _Listeners(Section):
    """The sections a config file opens with (a base class only to keep that order)."""

    listen: NonEmptyStr = Field(default="127.0.0.1:50051", description="where the public Gateway API listens")
    placements: Placements = Placements()
    limits: RequestLimits = RequestLimits()
    output_policy: OutputPolicyConfig = OutputPolicyConfig()
    batching: BatchingConfig = BatchingConfig()
    calls: CallsConfig = CallsConfig()
    internal: InternalConfig = InternalConfig()


class SpineConfig(ComponentConfig, _Listeners):
    """A whole spine config: the components' sections and the runtime's."""

    tracing: TracingConfig = TracingConfig()
    shadow: ShadowConfig = ShadowConfig()
    remote_addresses: RemoteAddresses = RemoteAddresses()
    envoy_api: EnvoyApiConfig = EnvoyApiConfig()
    http: HttpConfig = HttpConfig()
    tls: TlsConfig | None = Field(default=None, description="TLS and mTLS on every TCP listener and link")
    device: DeviceConfig = DeviceConfig()

    _written: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _the_models_timeout_cap(cls, data: Any) -> Any:
        """`inference.max_timeout_ms` is also the gateway's cap (`limits`), so that the check
        before the cache and the model's own read one key."""
        if not isinstance(data, Mapping):
            return data
        limits = data.get("limits")
        if isinstance(limits, Mapping) and "max_inference_timeout_ms" in limits:
            raise problem("not a key of limits; set inference.max_timeout_ms", "limits", "max_inference_timeout_ms")
        inference = data.get("inference")
        cap = inference.get("max_timeout_ms") if isinstance(inference, Mapping) else None
        if not isinstance(cap, int) or isinstance(cap, bool):
            return data
        if limits is None:
            limits = {}
        if not isinstance(limits, Mapping):
            return data
        return {**data, "limits": {**limits, "max_inference_timeout_ms": cap}}

    def model_post_init(self, context: Any) -> None:
        written = context.get("written") if isinstance(context, Mapping) else None
        self._written = copy.deepcopy(dict(written)) if written is not None else plain(self, exclude_unset=True)

    # -- deriving, and handing on --------------------------------------------------------------
    def written(self) -> dict[str, Any]:
        """The data this config was read from (a copy): the keys a file or an override gave."""
        return copy.deepcopy(self._written)

    def with_overrides(self, overrides: Mapping[str, Any]) -> Self:
        """This config with `overrides` merged over what was written (mappings deep, lists and
        scalars replaced); ConfigProblems lists what the result gets wrong."""
        return type(self).read(merge(self._written, overrides))

    def to_yaml(self) -> str:
        """The config as a file a child process loads back to an equal config."""
        return yaml.safe_dump(self.written(), sort_keys=False)

    @classmethod
    def read(cls, data: Mapping[str, Any]) -> Self:
        """The config of plain data (a merged file); ConfigProblems lists every problem, each with its path."""
        try:
            return cls.model_validate(data, context={"written": data})
        except ValidationError as error:
            raise ConfigProblems([str(p) for p in describe(error, cls)]) from None


@functools.cache
def root_model(registry: Registry = DEFAULT) -> type[SpineConfig]:
    """The root model for a component table: `SpineConfig` for the default one; for a table
    with more components (a test's new middleware), `SpineConfig` with their sections, their
    placements, call budgets and remote addresses, so a new section is checked like every
    other one."""
    if registry is DEFAULT:
        return SpineConfig
    fields: dict[str, Any] = {spec.name: (spec.config or Section, Field(default_factory=spec.config or Section))
                              for spec in registry if spec.name not in SpineConfig.model_fields}
    placements = placements_model(registry.placement_fields)
    calls = calls_model(registry.names)
    addresses = remote_addresses_model(registry.names)
    fields.update(placements=(placements, placements()), calls=(calls, calls()),
                  remote_addresses=(addresses, addresses()))
    return create_model("SpineConfig", __base__=SpineConfig, **fields)


SECTIONS: frozenset[str] = frozenset(SpineConfig.model_fields)


def merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Deep-merge mappings; lists and scalars in `over` replace those in `base`."""
    result = copy.deepcopy(dict(base))
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(result.get(key), Mapping):
            result[key] = merge(result[key], value)
        else:
            result[key] = copy.deepcopy(value)
    return result


def plain(model: BaseModel, *, exclude_unset: bool = False) -> dict[str, Any]:
    """A model as the plain data a YAML file holds, secrets included (a child process needs
    them): by alias, tuples as lists, paths as text."""
    return _plain(model.model_dump(by_alias=True, exclude_unset=exclude_unset))  # type: ignore[no-any-return]


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, Path):
        return str(value)
    return value


def json_schema() -> dict[str, Any]:
    """The JSON schema of a config file (`spine config schema`)."""
    return SpineConfig.model_json_schema()
