"""The config sections the runtime owns: placements, remote addresses, tracing, shadow traffic.

Placements and remote addresses have one field per component of the component table, so
they are built from it (`placements_model`, `remote_addresses_model`).

Light on purpose (pydantic only): the root model imports them, and loading a config must
not load OpenTelemetry or the migration code. `spine.runtime.tracing.TracingConfig` and
`spine.runtime.shadow.ShadowConfig` are these classes, re-exported where they are used.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Mapping
from typing import Annotated, Any, Literal, get_args

from pydantic import Field, SecretStr, StrictBool, StrictInt, create_model, model_validator

from services.config_model import Float, Items, NonEmptyStr, Section, problem

Placement = Literal["local", "remote"]
Share = Annotated[Float, Field(ge=0, le=1)]


class RemoteAddressesBase(Section):
    """`remote_addresses`: components already running elsewhere (e.g. Kubernetes Services),
    bound by gRPC target instead of spawned: `auth: dns:///spine-auth.spine.svc:50061`."""

    def given(self) -> dict[str, str]:
        return {name: target for name, target in self.model_dump().items() if target is not None}


@functools.cache
def placements_model(components: tuple[str, ...], models: tuple[str, ...]) -> type[Section]:
    """`placements` for `spine up --layout mixed`, one field per component. A component left
    out is remote, except the model, which is local: the spine exists to put the model next
    to the middlewares."""
    fields: dict[str, Any] = {name: (Placement, "local" if name in models else "remote") for name in components}
    return create_model("Placements", __base__=Section, __doc__=placements_model.__doc__, **fields)


@functools.cache
def remote_addresses_model(components: tuple[str, ...]) -> type[RemoteAddressesBase]:
    fields: dict[str, Any] = {name: (NonEmptyStr | None, None) for name in components}
    return create_model("RemoteAddresses", __base__=RemoteAddressesBase, **fields)


class InternalConfig(Section):
    """`internal`: the secret only the deployment's own parts share. It signs the marks the
    front puts on its shadow copies (`services.pipeline.internal_marks`); without it no
    request is ever treated as shadow traffic, whatever a client sends."""

    secret: SecretStr | None = None  # inline: for local trials only
    secret_env: NonEmptyStr | None = None  # the name of an environment variable holding it

    def key(self, environ: Mapping[str, str]) -> bytes | None:
        if self.secret is not None:
            return self.secret.get_secret_value().encode()
        if self.secret_env is not None:
            value = environ.get(self.secret_env, "")
            if len(value) < 16:
                raise ValueError(f"environment variable {self.secret_env} must hold at least 16 characters")
            return value.encode()
        return None


class CallsBase(Section):
    """`calls`: how the gateway calls its components — each stage's budget, and when a
    component in another process is ejected (calls fail fast) after failing in a row."""

    eject_after_failures: Annotated[StrictInt, Field(ge=1)] = 5
    ejection_ms: Annotated[Float, Field(gt=0)] = 1000.0  # doubles while probes fail
    max_ejection_ms: Annotated[Float, Field(gt=0)] = 30000.0


@functools.cache
def calls_model(components: tuple[str, ...]) -> type[CallsBase]:
    """`calls` with `budgets_ms`: per component, the call budget of its stages (over the
    component table's defaults: 250 ms for a middleware, 1 s for metrics and logs)."""
    fields: dict[str, Any] = {name: (Annotated[Float, Field(gt=0)] | None, None) for name in components}
    budgets = create_model("CallBudgets", __base__=Section, **fields)
    return create_model("CallsConfig", __base__=CallsBase, budgets_ms=(budgets, Field(default_factory=dict)))


Exporter = Literal["none", "console", "otlp"]
EXPORTERS: tuple[str, ...] = get_args(Exporter)


def otlp_available() -> bool:
    try:
        return importlib.util.find_spec("opentelemetry.exporter.otlp.proto.grpc.trace_exporter") is not None
    except ModuleNotFoundError:
        return False


class TracingConfig(Section):
    """The `tracing:` section (see `spine.runtime.tracing`)."""

    enabled: StrictBool = False
    sample_ratio: Share = 0.01
    exporter: Exporter = "none"

    @model_validator(mode="after")
    def _exporter_installed(self) -> TracingConfig:
        # Checked at load, where it can be fixed, rather than when the first span is exported.
        if self.exporter == "otlp" and self.enabled and not otlp_available():
            raise problem("'otlp' needs the opentelemetry-exporter-otlp-proto-grpc package, which is "
                          "not installed; pip install it or use 'console'", "exporter")
        return self

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> TracingConfig:
        return cls.parse(config.get("tracing"), "tracing")


# What two layouts' answers are compared on (`spine.runtime.decisions.Decision`'s fields);
# listed here so the shadow section's schema can name them.
DecisionField = Literal["status", "details", "auth", "ratelimit", "route", "cached", "tokens"]


class ShadowConfig(Section):
    """The `shadow:` section (see `spine.runtime.shadow`).

    Read by the built-in front, and by a spine given `layered_address`: the spine then
    mirrors `share` of its own answered requests to the layered gateway there and exports
    the comparisons on its /metrics (`spine.runtime.gateway_mirror`), for the parity gate
    where Envoy, not the front, splits traffic."""

    share: Share = 0.0
    layered_address: NonEmptyStr | None = None  # the layered gateway, e.g. dns:///spine-gateway-layered:50051
    compare: StrictBool = True
    calibration_share: Share = 0.1
    max_in_flight: Annotated[StrictInt, Field(ge=1, le=1024)] = 8
    timeout_s: Annotated[Float, Field(gt=0)] = 10.0
    ignore_fields: Items[DecisionField] = ("cached",)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ShadowConfig:
        return cls.parse(config.get("shadow"), "shadow")
