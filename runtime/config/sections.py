"""The config sections the runtime owns: placements, remote addresses, tracing, shadow traffic, TLS.

Placements, remote addresses and call budgets have one field per component of the component
table, so they are built from it (`placements_model`, `remote_addresses_model`, `calls_model`);
code reads them through their base classes (`PlacementsBase`, ...), which hold no field.

Light on purpose (pydantic only): the root model imports them, and loading a config must
not load OpenTelemetry or the migration code. `runtime.observability.tracing.TracingConfig` and
`runtime.shadow.traffic.ShadowConfig` are these classes, re-exported where they are used.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Mapping
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    Field,
    SecretStr,
    StrictBool,
    StrictInt,
    ValidationError,
    WrapValidator,
    create_model,
    model_validator,
)

from services.common.config_section import Float, Items, NonEmptyStr, Section, problem
from services.common.prometheus_http import ListenOrUnixAddress

Placement = Literal["local", "remote"]
PLACEMENT_NAMES: tuple[str, ...] = ("local", "remote")
Share = Annotated[Float, Field(ge=0, le=1)]


class RemoteAddressesBase(Section):
    """`remote_addresses`: components already running elsewhere (e.g. Kubernetes Services),
    bound by gRPC target instead of spawned: `auth: dns:///spine-auth.spine.svc:50061`."""

    def given(self) -> dict[str, str]:
        return {name: target for name, target in self.model_dump().items() if target is not None}


class PlacementsBase(Section):
    """`placements`: where each component runs, one field per component (`placements_model`)."""

    def names(self) -> dict[str, str]:
        """Each component's placement, `local` or `remote` (a foreign endpoint is remote)."""
        return {name: placement_name(getattr(self, name)) for name in type(self).model_fields}

    def foreign(self) -> dict[str, ForeignPlacement]:
        """The components placed on a service the team already runs, in its own protocol."""
        return {name: value for name in type(self).model_fields
                if isinstance(value := getattr(self, name), ForeignPlacement)}


class ForeignPlacement(Section):
    """`{remote: HOST:PORT, protocol: envoy-rls}`: the component is a service the team already
    runs, spoken to in its own protocol. It is what `remote` means for that component in every
    layout and migration stage; `local` is the spine's own (see `runtime.placement.foreign`)."""

    remote: NonEmptyStr  # a gRPC target: HOST:PORT, dns:///NAME:PORT, unix:PATH
    protocol: NonEmptyStr
    tenant_header: NonEmptyStr | None = None  # envoy-ext-authz: the header it names the tenant in (x-spine-tenant)
    domain: NonEmptyStr | None = None  # envoy-rls: its domain (default: ratelimit.domain)

    @model_validator(mode="after")
    def _options_fit_the_protocol(self) -> ForeignPlacement:
        if self.tenant_header is not None and self.protocol != "envoy-ext-authz":
            raise problem(f"only for protocol envoy-ext-authz, not {self.protocol}", "tenant_header")
        if self.domain is not None and self.protocol != "envoy-rls":
            raise problem(f"only for protocol envoy-rls, not {self.protocol}", "domain")
        return self

    def options(self) -> dict[str, Any]:
        """What the protocol's client reads (`ForeignApi.build_client`)."""
        return {key: value for key, value in self.model_dump().items() if value is not None}


def _placement_or_foreign(protocols: tuple[str, ...]) -> WrapValidator:
    """`local`, `remote`, or a foreign endpoint speaking one of `protocols`: one clear problem,
    not one per member of the union."""
    choices = ", ".join(protocols)

    def validate(value: Any, handler: Any) -> Any:
        if isinstance(value, str):
            if value not in PLACEMENT_NAMES:
                raise problem(f"expected local, remote or {{remote: HOST:PORT, protocol: {choices}}}",
                              show_input=True)
            return value
        if isinstance(value, ForeignPlacement):
            value = value.model_dump()
        if not isinstance(value, Mapping):
            raise problem(f"expected local, remote or {{remote: HOST:PORT, protocol: {choices}}}, "
                          f"got {type(value).__name__}")
        if "protocol" in value and value["protocol"] not in protocols:
            raise problem(f"expected one of {choices}, got {str(value['protocol'])[:64]!r}", "protocol")
        try:
            return ForeignPlacement.model_validate(value)
        except ValidationError as error:  # the first problem, at its key below this placement
            first = error.errors()[0]
            at = tuple(first["loc"]) + tuple((first.get("ctx") or {}).get("at", ()))
            messages = {"missing": "required",
                        "extra_forbidden": f"unknown key; known: {', '.join(ForeignPlacement.model_fields)}"}
            message = first["ctx"]["message"] if first["type"] == "config" else first["msg"]
            raise problem(messages.get(first["type"], message), *at) from None

    return WrapValidator(validate)


@functools.cache
def placements_model(components: tuple[tuple[str, str, tuple[str, ...]], ...]) -> type[PlacementsBase]:
    """`placements` for `spine up --layout mixed`, one field per component: (name, where it
    runs when left out, its foreign protocols). A component with foreign protocols may also
    name a service that speaks one of them: `{remote: HOST:PORT, protocol: envoy-rls}` (a
    `ForeignPlacement`)."""
    fields: dict[str, Any] = {}
    for name, default, protocols in components:
        if protocols:
            fields[name] = (Annotated[Placement | ForeignPlacement, _placement_or_foreign(protocols)], default)
        else:
            fields[name] = (Placement, default)
    return create_model("Placements", __base__=PlacementsBase, __doc__=placements_model.__doc__, **fields)


def placement_name(placement: Any) -> str:
    """`local` or `remote` for a placement as configured (a foreign endpoint is remote)."""
    return placement if isinstance(placement, str) else "remote"


class EnvoyApiConfig(Section):
    """`envoy_api`: Envoy's own APIs (ext_authz `Authorization.Check`, the rate limit service's
    `ShouldRateLimit`), answered with the auth and ratelimit components' decisions: in the
    layered layout by their own processes, and by a spine or gateway process for wherever the
    component is placed now.

    They are a trusted data plane's APIs: `ShouldRateLimit` spends any tenant's buckets and
    `Check` says which keys are good, so a spine or gateway serves them only on a listener of
    their own (`listen`), never on the Gateway's public one: a unix socket or loopback, or a
    TCP address beyond loopback only with mTLS (`tls.client_ca_file`) and `allowed_peers`.
    The layered auth and ratelimit processes answer theirs on their own internal listener,
    beside the component's own service, which already decides the same for whoever reaches it."""

    where = "envoy_api"

    enabled: StrictBool = True
    # None (the default): no spine or gateway process serves them. HOST:PORT or unix:PATH:
    # a listener of their own (beyond loopback: --allow-external, mTLS and allowed_peers).
    listen: ListenOrUnixAddress | None = None
    # The client certificates allowed to call them (a DNS name in the certificate's SANs, or
    # its subject's CN): any other caller is PERMISSION_DENIED. Needs mTLS on a TCP listener.
    allowed_peers: Items[NonEmptyStr] = ()


@functools.cache
def remote_addresses_model(components: tuple[str, ...]) -> type[RemoteAddressesBase]:
    """`remote_addresses`, one field per component."""
    fields: dict[str, Any] = {name: (NonEmptyStr | None, None) for name in components}
    return create_model("RemoteAddresses", __base__=RemoteAddressesBase, **fields)


class InternalConfig(Section):
    """`internal`: the secret only the deployment's own parts share. It signs the marks the
    front puts on its shadow copies (`services.pipeline.internal_marks`); without it no
    request is ever treated as shadow traffic, whatever a client sends."""

    where = "internal"

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


class CallBudgetsBase(Section):
    """`calls.budgets_ms`: per component, the call budget of its steps (`calls_model`)."""

    def given(self) -> dict[str, float]:
        return {name: ms for name, ms in self.model_dump().items() if ms is not None}


class CallsBase(Section):
    """`calls`: how the gateway calls its components — each step's budget, and when a
    component in another process is ejected (calls fail fast) after failing in a row."""

    eject_after_failures: Annotated[StrictInt, Field(ge=1)] = 5
    ejection_ms: Annotated[Float, Field(gt=0)] = 1000.0  # doubles while probes fail
    max_ejection_ms: Annotated[Float, Field(gt=0)] = 30000.0
    budgets_ms: CallBudgetsBase = CallBudgetsBase()  # the components' own, in `calls_model`


@functools.cache
def calls_model(components: tuple[str, ...]) -> type[CallsBase]:
    """`calls` with `budgets_ms`: per component, the call budget of its steps (over the
    component table's defaults: 250 ms for a middleware, 1 s for metrics and logs)."""
    fields: dict[str, Any] = {name: (Annotated[Float, Field(gt=0)] | None, None) for name in components}
    budgets = create_model("CallBudgets", __base__=CallBudgetsBase, **fields)
    return create_model("CallsConfig", __base__=CallsBase, budgets_ms=(budgets, budgets()))


Exporter = Literal["none", "console", "otlp"]
EXPORTERS: tuple[str, ...] = get_args(Exporter)


def otlp_available() -> bool:
    try:
        return importlib.util.find_spec("opentelemetry.exporter.otlp.proto.grpc.trace_exporter") is not None
    except ModuleNotFoundError:
        return False


class TracingConfig(Section):
    """The `tracing:` section (see `runtime.observability.tracing`)."""

    where = "tracing"

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


# What two layouts' answers are compared on (`runtime.shadow.decisions.Decision`'s fields);
# listed here so the shadow section's schema can name them.
DecisionField = Literal["status", "details", "auth", "ratelimit", "route", "cached", "tokens"]


class ShadowConfig(Section):
    """The `shadow:` section (see `runtime.shadow.traffic`).

    Read by the built-in front, and by a spine given `layered_address`: the spine then
    mirrors `share` of its own answered requests to the layered gateway there and exports
    the comparisons on its /metrics (`runtime.shadow.gateway_mirror`), for the parity gate
    where Envoy, not the front, splits traffic."""

    where = "shadow"

    share: Share = 0.0
    layered_address: NonEmptyStr | None = None  # the layered gateway, e.g. dns:///spine-gateway-layered:50051
    compare: StrictBool = True
    calibration_share: Share = 0.1
    max_in_flight: Annotated[StrictInt, Field(ge=1, le=1024)] = 8
    timeout_s: Annotated[Float, Field(gt=0)] = 10.0
    ignore_fields: Items[DecisionField] = ("cached",)


class TlsConfig(Section):
    """The `tls:` section: this process's certificate, and whom it trusts (see `runtime.tls`).

    With it every TCP listener of the process (the public Gateway, a layered child reached
    over TCP, the Envoy API listener, the front) speaks TLS, and with `client_ca_file` it
    requires a client certificate signed by that CA (mTLS). The same certificate is the
    process's identity when it calls another part of the deployment over TCP (a layered
    child, the controller's xDS, the layered gateway it mirrors to), so it needs both the
    serverAuth and clientAuth usages; it verifies those servers against `ca_file` (default
    `client_ca_file`, else the system's roots). Unix sockets, in 0700 run directories, stay
    plaintext. The files are re-read when they change (or on SIGHUP), without a restart.
    Absent (the default): plaintext everywhere.
    """

    where = "tls"

    cert_file: NonEmptyStr  # PEM: this process's certificate (chain), leaf first
    key_file: NonEmptyStr  # PEM: its private key
    client_ca_file: NonEmptyStr | None = None  # PEM CA bundle: clients must present a certificate it signed
    ca_file: NonEmptyStr | None = None  # PEM CA bundle: verifies the servers this process calls over TCP

    @property
    def server_ca_file(self) -> str | None:
        """What this process verifies the servers it calls against."""
        return self.ca_file or self.client_ca_file
