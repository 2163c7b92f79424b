"""Envoy's APIs in a running process, and components that are services the team already runs.

Answering Envoy: every process that holds or reaches a component with a `ForeignApi` (auth:
ext_authz, ratelimit: the rate limit service) also serves that API (`envoy_apis`). A layered
child answers it with its own servicer; a spine or gateway with the component's binding *as
placed now*, looked up on every call, so Envoy's filters get the same decision as the
Gateway path at every stage of a migration: from a remote component while it is remote, from
the spine's own state once it is local.

Speaking to a service the team already runs: a placement `{remote: HOST:PORT, protocol: P}`
binds the component with a `ForeignBinding`, a remote binding whose stub is the protocol's
client (`ForeignApi.client`): the pipeline calls the component's own batch rpcs and the client
turns them into the foreign protocol's calls. Its health is the service's own gRPC health
(the overall status, `""`); a service without a health service is up while it answers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from runtime.bindings import LocalBinding
from runtime.remote_binding import RemoteBinding
from runtime.sections import EnvoyApiConfig, ForeignPlacement
from runtime.server import RunningServer
from services.common.outlier import OutlierDetector
from services.pipeline.calls import Hook
from services.registry import ComponentSpec, ForeignApi, Registry


class ForeignBinding(RemoteBinding):
    """A remote binding to a service that speaks another protocol (`ForeignApi.client`)."""

    def __init__(self, spec: ComponentSpec, endpoint: ForeignPlacement, config: Mapping[str, Any],
                 channel: grpc.Channel, hooks: Sequence[Hook] = (), outlier: OutlierDetector | None = None,
                 health_timeout_s: float = 0.5) -> None:
        self.api = foreign_api(spec, endpoint.protocol)
        self.endpoint = endpoint
        self.health_timeout_s = health_timeout_s
        client = self.api.build_client(channel, endpoint.options(), config)
        # RemoteBinding makes its stub from the channel; this one is already made.
        super().__init__(spec.name, spec.descriptor(), cast(type, lambda _channel: client), channel, hooks,
                         outlier=outlier)

    def health(self) -> tuple[bool, str]:
        """(serving, reason) from the service's overall gRPC health."""
        where = f"{self.api.protocol} service at {self.endpoint.remote}"
        try:
            reply = health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                                   timeout=self.health_timeout_s)
        except grpc.RpcError as error:
            code = error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNKNOWN
            if code == grpc.StatusCode.UNIMPLEMENTED:
                return True, f"{where}: answering (it has no health service)"
            return False, f"{where}: {getattr(code, 'name', code)}"
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{where}: {status}"


def foreign_endpoints(checked: Any) -> dict[str, ForeignPlacement]:
    """The components a validated config's `placements:` binds to a service in its protocol."""
    return {name: placement for name, placement in checked.placements if isinstance(placement, ForeignPlacement)}


def foreign_api(spec: ComponentSpec, protocol: str) -> ForeignApi:
    for api in spec.foreign:
        if api.protocol == protocol:
            return api
    known = ", ".join(api.protocol for api in spec.foreign) or "none"
    raise ValueError(f"{spec.name} cannot be reached over {protocol!r} (its foreign protocols: {known})")


def envoy_apis(registry: Iterable[ComponentSpec], config: Mapping[str, Any], client_for: Callable[[str], Any],
               budgets_s: Mapping[str, float] | None = None) -> list[tuple[ComponentSpec, Any]]:
    """The foreign APIs this process answers (none when `envoy_api.enabled` is false), each built
    on `client_for(component)`: the component's binding, looked up on every call."""
    if not EnvoyApiConfig.from_config(config).enabled:
        return []
    budgets = budgets_s or {}
    served: list[tuple[ComponentSpec, Any]] = []
    for spec in registry:
        call = _caller(spec.name, client_for, budgets.get(spec.name, spec.budget_ms / 1000.0))
        served.extend((api.served(), api.build_server(config, call)) for api in spec.foreign)
    return served


def envoy_apis_of(spec: ComponentSpec, servicer: Any, config: Mapping[str, Any]) -> list[tuple[ComponentSpec, Any]]:
    """What a layered child answers beside its own service: its foreign APIs on its own servicer."""
    binding = LocalBinding(spec.name, spec.descriptor(), servicer)
    return envoy_apis([spec], config, lambda _name: binding)


class EnvoyApiHealth:
    """The health a server reports for the foreign APIs it answers: each one SERVING while its
    component is (as the gateway's health sees it); on a listener of their own, the overall
    status (`""`, what Envoy's active health check asks) too, while every one of them is."""

    def __init__(self, registry: Registry, running: RunningServer, own_listener: bool) -> None:
        self.running = running
        self.own_listener = own_listener
        self._services = {spec.name: [api.served().full_name for api in spec.foreign] for spec in registry
                          if spec.foreign}
        self._down: set[str] = set()

    def flip(self, component: str, serving: bool) -> None:
        services = self._services.get(component)
        if not services:
            return
        if serving:
            self._down.discard(component)
        else:
            self._down.add(component)
        for service in services:
            self.running.set_serving(serving, service)
        if self.own_listener:
            self.running.set_serving(not self._down, "")


def _caller(component: str, client_for: Callable[[str], Any], budget_s: float) -> Callable[[str, Any], Any]:
    def call(method: str, request: Any) -> Any:
        return client_for(component).call(method, request, timeout=budget_s)
    return call
