"""The HTTP endpoint serving GET /metrics: prometheus_client's WSGI app on a loopback socket.

prometheus_client writes the exposition and negotiates its format from the Accept header
(the Prometheus text format by default, OpenMetrics for `application/openmetrics-text`,
gzip when asked); this module only binds it, serves it from a daemon thread and answers
404 for every other path.

Loopback only unless asked otherwise: metrics name tenants and models, so exposing them on
every interface has to be a decision someone wrote down (`allow_external=True`).
"""

from __future__ import annotations

import ipaddress
import socket
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Annotated, Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app
from prometheus_client.registry import Collector
from pydantic import AfterValidator

from services.common.config_section import NonEmptyStr, problem


def parse_listen(listen: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` -> (host, port); ValueError naming the value otherwise."""
    host, sep, port_text = listen.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"listen address {listen!r}: expected HOST:PORT, e.g. 127.0.0.1:9464")
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"listen address {listen!r}: port {port} is above 65535")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, port



def _listen_checked(listen: str) -> str:
    try:
        parse_listen(listen)
    except ValueError as exc:
        raise problem(str(exc)) from None
    return listen


def _listen_or_unix_checked(listen: str) -> str:
    if listen.startswith("unix:"):
        if len(listen) == len("unix:"):
            raise problem("unix: needs a path, e.g. unix:/run/spine/envoy.sock")
        return listen
    return _listen_checked(listen)


# A config key naming a HOST:PORT to listen on: checked when the config is read (a typo is
# one line at start, exit 2, not a failed bind after children have started).
ListenAddress = Annotated[NonEmptyStr, AfterValidator(_listen_checked)]
# The same, or a unix socket (unix:PATH).
ListenOrUnixAddress = Annotated[NonEmptyStr, AfterValidator(_listen_or_unix_checked)]

def is_loopback(host: str) -> bool:
    """True for localhost and loopback IPs (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Server6(ThreadingWSGIServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes every few seconds would flood stderr; stay quiet."""


WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def metrics_app(registry: Collector) -> WSGIApp:
    """prometheus_client's app for `registry` at /metrics only; a failed scrape is a 500."""
    app = make_wsgi_app(registry)

    def serve(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"not found: metrics are at /metrics\n"]
        try:
            # The app renders the whole body before it starts the response.
            return app(environ, start_response)  # type: ignore[no-any-return]
        except Exception as exc:  # a scrape must not take the server thread down
            start_response("500 Internal Server Error", [("Content-Type", "text/plain; charset=utf-8")],
                           sys.exc_info())
            return [f"rendering metrics failed: {exc}\n".encode()]

    return serve


class PrometheusHTTPServer:
    """Serves `registry` at GET /metrics from a daemon thread; 404 for every other path."""

    def __init__(
        self, registry: Collector, listen: str = "127.0.0.1:0", *, allow_external: bool = False
    ) -> None:
        host, port = parse_listen(listen)
        if not allow_external and not is_loopback(host):
            raise ValueError(
                f"refusing to serve metrics on {listen!r}: not a loopback address; "
                "pass allow_external=True (metrics.allow_external: true) to expose it"
            )
        self._app = metrics_app(registry)
        self._host = host
        self._port = port
        self._server: ThreadingWSGIServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        """`host:port` actually bound (the real port when asked for port 0)."""
        if self._server is None:
            raise RuntimeError("PrometheusHTTPServer.address: call start() first")
        host, port = self._server.server_address[:2]
        host = host.decode() if isinstance(host, bytes) else str(host)
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def start(self) -> None:
        if self._server is not None:
            return
        server_cls = _Server6 if ":" in self._host else ThreadingWSGIServer
        self._server = make_server(self._host, self._port, self._app, server_cls, _QuietHandler)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.2}, name="metrics-http", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and close the socket; safe to call twice."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> PrometheusHTTPServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
