"""Envoy's APIs in a running process, and components that are services the team already runs.

Answering Envoy: every process that holds or reaches a component with a `ForeignApi` (auth:
ext_authz, ratelimit: the rate limit service) also serves that API (`envoy_apis`). A layered
child answers it with its own servicer; a spine or gateway with the component *as placed
now*, looked up on every call, so Envoy's filters get the same decision as the Gateway path
at every stage of a migration: from a remote component while it is remote, from the
spine's own state once it is local.

Speaking to a service the team already runs: a placement `{remote: HOST:PORT, protocol: P}`
reaches the component through that protocol's client (`ForeignApi.client`), one more
implementation of its interface (`foreign_client`), guarded by the same outlier ejection as a
remote one. Its health is the service's own gRPC health (the overall status, `""`); a service
without a health service is up while it answers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from runtime.config.model import SpineConfig
from runtime.config.sections import ForeignPlacement
from runtime.placement.in_process import in_process
from runtime.placement.remote import guarded
from runtime.server import RunningServer
from services.common.outlier import OutlierDetector
from services.component import ComponentConfig, ComponentSpec, ForeignApi
from services.pipeline.interface import Placed
from services.registry import Registry

T = TypeVar("T")  # a component's interface


def foreign_client(spec: ComponentSpec[T], endpoint: ForeignPlacement, config: ComponentConfig,
                   channel: grpc.Channel, detector: OutlierDetector) -> T:
    """The component `spec` as the service at `endpoint` answers it, in that service's protocol."""
    assert spec.interface is not None, f"{spec.name} has no interface"
    client = foreign_api(spec, endpoint.protocol).build_client(channel, endpoint.options(), config)
    return guarded(spec.interface, client, detector)


def foreign_health(endpoint: ForeignPlacement, channel: grpc.Channel,
                   timeout_s: float) -> Callable[[], tuple[bool, str]]:
    """(serving, reason) of the service at `endpoint`, from its overall gRPC health."""
    where = f"{endpoint.protocol} service at {endpoint.remote}"
    stub = health_pb2_grpc.HealthStub(channel)

    def health() -> tuple[bool, str]:
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.RpcError as error:
            code = error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNKNOWN
            if code == grpc.StatusCode.UNIMPLEMENTED:
                return True, f"{where}: answering (it has no health service)"
            return False, f"{where}: {getattr(code, 'name', code)}"
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{where}: {status}"

    return health


def foreign_api(spec: ComponentSpec[T], protocol: str) -> ForeignApi[T]:
    for api in spec.foreign:
        if api.protocol == protocol:
            return api
    known = ", ".join(api.protocol for api in spec.foreign) or "none"
    raise ValueError(f"{spec.name} cannot be reached over {protocol!r} (its foreign protocols: {known})")


def envoy_apis(registry: Iterable[ComponentSpec[Any]], config: SpineConfig, placed: Placed,
               budgets_s: Mapping[str, float] | None = None) -> list[tuple[ComponentSpec[Any], object]]:
    """The foreign APIs this process answers (none when `envoy_api.enabled` is false), each on
    its component as `placed` at the time of each call."""
    if not config.envoy_api.enabled:
        return []
    budgets = budgets_s or {}
    served: list[tuple[ComponentSpec[Any], object]] = []
    for spec in registry:
        budget_s = budgets.get(spec.name, spec.budget_ms / 1000.0)
        served.extend((api.served(), api.build_server(config, placed, budget_s)) for api in spec.foreign)
    return served


def envoy_apis_of(spec: ComponentSpec[T], servicer: T, config: SpineConfig) -> list[tuple[ComponentSpec[Any], object]]:
    """What a layered child answers beside its own service: its foreign APIs on its own servicer."""
    if spec.interface is None:
        return []
    return envoy_apis([spec], config, Placed({spec.name: in_process(spec.interface, servicer)}))


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
