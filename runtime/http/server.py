"""uvicorn (httptools parser, uvloop) in a thread of the serving process.

Chosen by measurement (a blocking handler on a thread pool, JSON in and out, wrk on the other
core, two runs each): a plain ASGI app on uvicorn answered a lone request fastest, ahead of
Starlette's routing on top and of aiohttp; at high concurrency the three were within each
other's noise, far above what a model serves. uvicorn also has the pieces this
server needs: TLS from files and a protocol class that can be extended.

What uvicorn lacks — bounds on a request's head, a connection cap at accept, a deadline for
the headers — `runtime.http.bounded_protocol` adds; the app bounds the body (`runtime.http.body`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
import threading
from typing import Any

import uvicorn

from runtime.config.http import HttpConfig
from runtime.config.sections import TlsConfig
from runtime.http.bounded_protocol import bounded_protocol
from runtime.server import check_listen
from services.common.loop_bound import close_bound
from services.common.thread_names import name_os_thread
from services.pipeline.limits import RequestLimits
from services.router.config import RouterConfig

log = logging.getLogger("spine.http")


class HttpServer:
    """The HTTP API on `listen` (loopback unless `allow_external`), served from a thread."""

    def __init__(self, app: Any, config: HttpConfig, listen: str, *, tls: TlsConfig | None = None,
                 allow_external: bool = False) -> None:
        check_listen(listen, allow_external)
        self._socket, self.address = _bind(listen)
        if self.address.startswith("unix:"):
            tls = None  # a unix socket stays plaintext, as every gRPC one does
        self.scheme = "https" if tls is not None else "http"
        protocol = bounded_protocol(config, app.refusal)
        options: dict[str, Any] = {}
        if tls is not None:
            options = {"ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file}
            if tls.client_ca_file is not None:
                options.update(ssl_ca_certs=tls.client_ca_file, ssl_cert_reqs=ssl.CERT_REQUIRED)
        self._config = uvicorn.Config(
            app, loop="uvloop", http=protocol, lifespan="off", log_level="warning", access_log=False,
            server_header=False,  # the connection cap is the protocol's, at accept (`bounded_protocol`)
            timeout_keep_alive=config.keepalive_s, timeout_graceful_shutdown=3, **options)
        self._server = uvicorn.Server(self._config)
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float = 10.0) -> HttpServer:
        started = threading.Event()
        failed: list[BaseException] = []

        def serve() -> None:
            name_os_thread()  # "http-server" in the kernel too: the bench reads CPU by thread name
            try:
                self._run()
            except BaseException as error:  # a bad certificate file, say: told to start()
                failed.append(error)
            finally:
                started.set()

        self._thread = threading.Thread(target=serve, name="http-server", daemon=True)
        self._thread.start()
        while not started.is_set() and not self._server.started:
            started.wait(0.01)
            timeout_s -= 0.01
            if timeout_s <= 0:
                raise TimeoutError(f"the HTTP listener on {self.address} did not start")
        if failed:
            raise failed[0]
        if not self._server.started:
            raise OSError(f"the HTTP listener on {self.address} stopped as it started")
        log.info("HTTP API serving on %s://%s", self.scheme, self.address)
        return self

    def _run(self) -> None:
        """uvicorn's `Server.run`, and then, on the same loop, what requests opened on it
        (the connection pools of the upstreams it awaited, `services.common.loop_bound`)."""
        async def serve() -> None:
            try:
                await self._server.serve(sockets=[self._socket])
            finally:
                await close_bound()

        with asyncio.Runner(loop_factory=self._config.get_loop_factory()) as runner:
            runner.run(serve())

    def stop(self, grace: float = 3.0) -> None:
        """Stop accepting, finish in-flight requests (up to `grace` seconds), then close."""
        self._config.timeout_graceful_shutdown = max(1, round(grace))
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(grace + 2.0)
            self._thread = None
        self._socket.close()
        if self.address.startswith("unix:"):
            with contextlib.suppress(OSError):
                os.unlink(self.address[len("unix:"):])


def _bind(listen: str) -> tuple[socket.socket, str]:
    """A bound socket for `listen` (HOST:PORT, [V6]:PORT or unix:PATH) and the address it has
    (the port a `:0` was given). A unix socket file is made readable by its owner only: the
    run directory's permissions are the access control there, as for the gRPC sockets."""
    if listen.startswith("unix:"):
        path = listen[len("unix:"):]
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a stale socket file from a process that died
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            os.chmod(path, 0o600)
        except OSError as error:
            sock.close()
            raise OSError(f"could not bind the HTTP listener {listen}: {error.strerror}") from None
        return sock, listen
    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, int(port)))
    except (OSError, ValueError) as error:
        sock.close()
        raise OSError(f"could not bind the HTTP listener {listen}: {getattr(error, 'strerror', None) or error}") \
            from None
    bound = sock.getsockname()[1]
    return sock, (f"[{host}]:{bound}" if family == socket.AF_INET6 else f"{host}:{bound}")


def start_http(target: Any, http: HttpConfig, router: RouterConfig, limits: RequestLimits, threads: int,
               listen: str, *, layout: Any, serving: Any, tls: TlsConfig | None = None,
               allow_external: bool = False, admin: Any = None) -> tuple[HttpServer, Any]:
    """The HTTP API in front of `target` (a Gateway-shaped servicer) on `listen`, on the
    `http`, `router` and `limits` sections, with `threads` handler threads and, given the
    admin API (`runtime.admin_api.AdminApi`), `/admin/`; (server, app), both to be closed."""
    from runtime.http.admin_http import AdminHttp
    from runtime.http.app import HttpApi

    names = [(name, model.id) for model in router.models for name in (model.id, *model.aliases)]
    app = HttpApi(target, http, threads=threads,
                  default_max_tokens=limits.max_tokens,
                  layout=layout, models=lambda: names, serving=serving,
                  admin=None if admin is None else AdminHttp(admin))
    try:
        server = HttpServer(app, http, listen, tls=tls, allow_external=allow_external).start()
    except BaseException:
        app.close()
        raise
    return server, app
