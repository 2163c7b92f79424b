"""A small HTTP endpoint serving GET /metrics in the Prometheus text format.

Loopback only unless asked otherwise: metrics name tenants and models, so exposing them on
every interface has to be a decision someone wrote down (`allow_external=True`).
"""

from __future__ import annotations

import ipaddress
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


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


def is_loopback(host: str) -> bool:
    """True for localhost and loopback IPs (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Server(ThreadingHTTPServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class PrometheusHTTPServer:
    """Serves `render()` at GET /metrics from a daemon thread; 404 for every other path."""

    def __init__(
        self, render: Callable[[], str], listen: str = "127.0.0.1:0", *, allow_external: bool = False
    ) -> None:
        host, port = parse_listen(listen)
        if not allow_external and not is_loopback(host):
            raise ValueError(
                f"refusing to serve metrics on {listen!r}: not a loopback address; "
                "pass allow_external=True (metrics.allow_external: true) to expose it"
            )
        self._render = render
        self._host = host
        self._port = port
        self._server: _Server | None = None
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
        server_cls = _Server6 if ":" in self._host else _Server
        self._server = server_cls((self._host, self._port), _handler(self._render))
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


def _handler(render: Callable[[], str]) -> type[BaseHTTPRequestHandler]:
    class MetricsHandler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the name http.server dispatches on
            if urlsplit(self.path).path != "/metrics":
                self._reply(404, "text/plain; charset=utf-8", b"not found: metrics are at /metrics\n")
                return
            try:
                body = render().encode("utf-8")
            except Exception as exc:  # a scrape must not kill the server thread
                self._reply(500, "text/plain; charset=utf-8", f"rendering metrics failed: {exc}\n".encode())
                return
            self._reply(200, CONTENT_TYPE, body)

        def _reply(self, code: int, content_type: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            """Scrapes every few seconds would flood stderr; stay quiet."""

    return MetricsHandler
