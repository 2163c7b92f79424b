"""The listeners in front of a layout's gateway: gRPC, Envoy's APIs, the HTTP API.

Envoy's APIs (ext_authz, the rate limit service) for the components that have one are served
on a listener of their own (`envoy_api.listen`), never on the Gateway's: they spend any
tenant's buckets and confirm keys for whoever calls, so only the data plane may reach them (a
unix socket, loopback, or mTLS with `envoy_api.allowed_peers`). Without `envoy_api.listen`
this process serves none. Each Envoy API is as healthy as its component. The OpenAI/Anthropic-compatible HTTP API
(`runtime.http`) serves the same gateway on its own address when one is given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from runtime.allowed_peers import envoy_interceptors
from runtime.config.model import SpineConfig
from runtime.config.sections import TlsConfig
from runtime.placement.foreign import EnvoyApiHealth
from runtime.server import RunningServer, request_pool, request_threads, start_server
from runtime.tls import is_unix
from services.common import ConfigError
from services.common.prometheus_http import is_loopback, parse_listen
from services.gateway.service import Gateway
from services.registry import GATEWAY, Registry


class Listeners:
    """The gateway's gRPC server, Envoy's APIs' server (when on a listener of their own) and
    the HTTP API's server."""

    def __init__(self, config: SpineConfig, *, allow_external: bool, tls: TlsConfig | None,
                 max_message_bytes: int) -> None:
        self.config = config
        self.allow_external = allow_external
        self.tls = tls
        self.max_message_bytes = max_message_bytes
        self.server: RunningServer | None = None
        self.envoy_server: RunningServer | None = None
        self.envoy_health: EnvoyApiHealth | None = None
        self.http_server: Any = None
        self._http_app: Any = None

    def start_grpc(self, gateway: Gateway, listen: str, envoy: list[tuple[Any, Any]], envoy_listen: str | None,
                   registry: Registry, probe_listen: str | None,
                   admin: list[tuple[Any, Any]] | None = None) -> RunningServer:
        """The gateway (and the admin API's services, `admin`) on `listen`; Envoy's APIs,
        `envoy`, on `envoy_listen` alone (none without it)."""
        if envoy and envoy_listen is not None:
            self._check_envoy_listener(envoy_listen)
        self.server = start_server([(GATEWAY, gateway), *(admin or [])], listen,
                                   max_message_bytes=self.max_message_bytes, allow_external=self.allow_external,
                                   tls=self.tls, probe_listen=probe_listen, **request_pool(self.config.inference))
        if envoy and envoy_listen is not None:
            self.envoy_server = start_server(envoy, envoy_listen, max_message_bytes=self.max_message_bytes,
                                             allow_external=self.allow_external, tls=self.tls,
                                             interceptors=envoy_interceptors(self.config.envoy_api.allowed_peers,
                                                                             envoy, self._mtls(envoy_listen)))
            # each Envoy API is as healthy as its component (`flip`, on every change)
            self.envoy_health = EnvoyApiHealth(registry, self.envoy_server, own_listener=True)
        return self.server

    def _check_envoy_listener(self, listen: str) -> None:
        """Refuse an Envoy API listener that anyone could call: beyond loopback it needs mTLS
        and a list of the peers allowed; a list of peers needs certificates to read them from."""
        peers = self.config.envoy_api.allowed_peers
        if peers and not self._mtls(listen):
            raise ConfigError("envoy_api.allowed_peers: the peers are named by their client certificates, so "
                              f"envoy_api.listen ({listen}) must be a TCP address and tls.client_ca_file set")
        if not is_unix(listen) and not is_loopback(parse_listen(listen)[0]) and not peers:
            raise ConfigError(f"envoy_api.listen {listen} is beyond loopback: Envoy's APIs spend any tenant's "
                              "rate limit, so set tls (with client_ca_file) and envoy_api.allowed_peers (the "
                              "data plane's certificate names), or listen on loopback or a unix socket")

    def _mtls(self, listen: str) -> bool:
        """Whether a listener on `listen` asks its clients for certificates."""
        return self.tls is not None and self.tls.client_ca_file is not None and not is_unix(listen)

    def start_http(self, gateway: Gateway, listen: str | None, serving: Callable[[], bool], admin: Any = None) -> None:
        """The HTTP API in front of `gateway` on `listen` (None: none), with `/admin/` when
        given the admin API (`runtime.admin_api.AdminApi`)."""
        if listen is None:
            return
        from runtime.http.server import start_http

        config = self.config
        self.http_server, self._http_app = start_http(
            gateway, config.http, config.router, config.limits, request_threads(config.inference), listen,
            layout=lambda: gateway.layout, serving=serving, tls=self.tls, allow_external=self.allow_external,
            admin=admin)

    def flip(self, component: str, serving: bool) -> None:
        """A component's health changed: so did its Envoy API's."""
        if self.envoy_health is not None:
            self.envoy_health.flip(component, serving)

    def stop_http(self, grace: float) -> None:
        """Stop the HTTP API first: its in-flight requests finish on the gateway."""
        if self.http_server is not None:
            self.http_server.stop(grace)
            self.http_server = None
        if self._http_app is not None:
            self._http_app.close()
            self._http_app = None

    def stop_grpc(self, grace: float) -> None:
        if self.server is not None:
            self.server.stop(grace)
            self.server = None
        if self.envoy_server is not None:
            self.envoy_server.stop(grace)
            self.envoy_server = None
