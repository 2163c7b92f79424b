"""The dashboard's HTTP(S) server: the page, its live data, the operator's buttons, /metrics.

    GET  /                      the page (plain HTML, CSS and JavaScript, no build step)
    GET  /api/state             the snapshot (`migration.dashboard.document`) as JSON
    GET  /api/events            the same, as server-sent events: at once, on every transition,
                                and at least every second (the page is never 2 s behind)
    POST /api/commands/NAME     pause, resume, advance, approve, rollback (JSON body: actor,
                                reason, stage): the admin token, always
    GET  /metrics               the controller's spine_migration_* families (Prometheus)

Reading (state, events, metrics) needs the admin token too unless the operator allowed
viewing without it (`view_without_token`); the page and its static files never do (they hold
no data). The token travels as `Authorization: Bearer <token>`, compared in constant time
(`migration.admin_token`), never in a cookie or a URL, so another site cannot make a
browser send it (no CSRF), and is never logged. A command runs through
`migration.service.run_command`, the code the gRPC API (`spine migrate ...`) runs, and the
audit trail names the actor the page gives, the dashboard and the client's address.

It listens where the controller's admin API may (loopback unless `allow_external`, and
beyond loopback only with TLS: `migration.server.check_listen`) and speaks TLS (mTLS with a
client CA) with the controller's own certificate. On loopback it answers only requests
whose Host is a loopback name, so a page on another site cannot reach it by DNS rebinding.
"""

from __future__ import annotations

import contextlib
import html
import json
import logging
import re
import socket
import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.registry import Collector

from migration.admin_token import bearer, token_matches
from migration.controller import Controller
from migration.dashboard.document import LayoutSampler, snapshot
from migration.lease import Fenced
from migration.plan import PlanError
from migration.service import run_command
from migration.store_backends import StoreUnavailable
from migration.transitions import InvalidTransition
from runtime.config.sections import TlsConfig
from services.common.log_limit import RateLimitedLog
from services.common.prometheus_http import is_loopback, parse_listen

log = logging.getLogger("spine.migration.dashboard")
_refused_tokens = RateLimitedLog(log, "admin tokens not accepted")  # a guessing loop: one line a second
STATIC = Path(__file__).resolve().parent / "static"
FILES = {"/": ("index.html", "text/html; charset=utf-8"),
         "/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
         "/dashboard.css": ("dashboard.css", "text/css; charset=utf-8")}
BUTTONS = ("pause", "resume", "advance", "approve", "rollback")
HEARTBEAT_S = 1.0
MAX_BODY = 16384
_ACTOR = re.compile(r"[^A-Za-z0-9_.@+-]")


class DashboardServer:
    """The dashboard on `listen` (HOST:PORT), serving until `stop`."""

    def __init__(self, controller: Controller, admin_token: str, target: Any, listen: str, *,
                 tls: TlsConfig | None = None, view_without_token: bool = False,
                 collectors: tuple[Collector, ...] = ()) -> None:
        self.controller = controller
        self.token = admin_token.encode()
        self.view_without_token = view_without_token
        self.sampler = LayoutSampler(target)
        self.registry = CollectorRegistry(auto_describe=False)
        for collector in collectors:
            self.registry.register(collector)
        self.stopping = threading.Event()
        self.heartbeat_s = HEARTBEAT_S  # an event at least this often, and at once on every transition
        self._streams = 0  # event streams open now: `stop` waits for them before the store closes
        self._streams_done = threading.Condition()
        host, port = parse_listen(listen)
        self.loopback = is_loopback(host)
        self._ssl = _server_context(tls) if tls is not None else None
        self._httpd = _Server((host, port), _Handler, self)
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="migration-dashboard", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        name = host.decode() if isinstance(host, bytes) else str(host)
        shown = f"[{name}]" if ":" in name else name
        return f"{'https' if self._ssl else 'http'}://{shown}:{port}/"

    def start(self) -> None:
        self._thread.start()
        log.info("migration dashboard on %s (viewing %s)", self.url,
                 "without a token" if self.view_without_token else "needs the admin token")

    @contextlib.contextmanager
    def streaming(self) -> Iterator[None]:
        """One open event stream, for as long as the block runs (`stop` waits for them all)."""
        with self._streams_done:
            self._streams += 1
        try:
            yield
        finally:
            with self._streams_done:
                self._streams -= 1
                self._streams_done.notify_all()

    def stop(self) -> None:
        self.stopping.set()
        self.controller.wake_watchers()
        with self._streams_done:
            self._streams_done.wait_for(lambda: self._streams == 0, timeout=2.0)
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def state(self) -> dict[str, Any]:
        return snapshot(self.controller, self.sampler, view_without_token=self.view_without_token)


def _server_context(tls: TlsConfig) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(tls.cert_file, tls.key_file)
    if tls.client_ca_file:
        context.load_verify_locations(tls.client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], app: DashboardServer) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.app = app
        super().__init__(address, handler)

    def finish_request(self, request: Any, client_address: Any) -> None:
        """The TLS handshake in the connection's own thread: a slow client stalls no other."""
        context = self.app._ssl
        if context is not None:
            try:
                request.settimeout(10.0)
                request = context.wrap_socket(request, server_side=True)
                request.settimeout(None)
            except (ssl.SSLError, OSError) as error:
                log.info("dashboard: TLS handshake with %s refused: %s", client_address[0], error)
                return
        super().finish_request(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: every page polls; refusals are logged where they happen."""

    @property
    def app(self) -> DashboardServer:
        return self.server.app

    def do_GET(self) -> None:
        if not self._host_allowed():
            return
        path = self.path.split("?", 1)[0]
        if path == "/":
            self._send(200, self._page(), FILES[path][1])
        elif path in FILES:
            name, content_type = FILES[path]
            self._send(200, (STATIC / name).read_bytes(), content_type)
        elif path in ("/api/state", "/api/events", "/metrics"):
            if not self._may_view():
                return
            if path == "/api/state":
                self._json(200, self.app.state())
            elif path == "/metrics":
                self._send(200, generate_latest(self.app.registry), "text/plain; version=0.0.4; charset=utf-8")
            else:
                self._events()
        else:
            self._json(404, {"error": f"no such page: {path}"})

    def do_POST(self) -> None:
        if not self._host_allowed():
            return
        path = self.path.split("?", 1)[0]
        command = path.removeprefix("/api/commands/")
        if command == path or command not in BUTTONS:
            self._json(404, {"error": f"no such command: {path} (one of {', '.join(BUTTONS)})"})
            return
        if not self._authorized("run a command"):
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            self._json(400, {"error": "Content-Length: not a number"})
            return
        if length < 0 or length > MAX_BODY:
            self._json(413, {"error": f"body of {length} bytes; at most {MAX_BODY}"})
            return
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
            if not isinstance(body, dict):
                raise ValueError("expected a JSON object")
        except ValueError as error:
            self._json(400, {"error": f"body: {error}"})
            return
        name = _ACTOR.sub("", str(body.get("actor") or ""))[:64] or "unnamed"
        actor = f"{name}@dashboard({self.client_address[0]})"
        try:
            run_command(self.app.controller, command, actor, str(body.get("reason") or "")[:500],
                        str(body.get("stage") or ""))
        except (InvalidTransition, PlanError, Fenced) as error:  # Fenced: another replica leads (named)
            self._json(409, {"error": str(error)})
            return
        except StoreUnavailable as error:
            self._json(503, {"error": f"the state store did not answer ({error}); retry"})
            return
        self._json(200, {"ok": True, "command": command, "actor": actor, "state": self.app.state()})

    # --- helpers -------------------------------------------------------------------------

    def _page(self) -> bytes:
        """The page, with the plan's stages already in it where viewing needs no token (so it
        says something before its script has connected, and without JavaScript)."""
        page = (STATIC / "index.html").read_text(encoding="utf-8")
        plan = self.app.controller.plan if self.app.view_without_token else None
        if plan is not None:
            items = "".join(f'<li data-stage="{html.escape(stage.name)}"><div class="name">{number}. '
                            f'{html.escape(stage.name)}</div><div class="detail">spine {stage.spine_weight:g}%</div></li>'
                            for number, stage in enumerate(plan.stages, start=1))
            page = page.replace("<!--STAGES-->", items)
        return page.encode()

    def _host_allowed(self) -> bool:
        if not self.app.loopback:
            return True
        host = (self.headers.get("Host") or "").rsplit(":", 1)[0].strip("[]")
        if is_loopback(host):
            return True
        self._json(421, {"error": f"Host {host!r}: this dashboard answers loopback names only"})
        return False

    def _authorized(self, what: str) -> bool:
        presented = bearer(self.headers.get("Authorization") or "")
        if not presented:
            self._json(401, {"error": f"the admin token is needed to {what}: enter it on the page "
                                      "(sent as `Authorization: Bearer <token>`)"})
            return False
        if not token_matches(presented, self.app.token):
            _refused_tokens(None, "dashboard: admin token not accepted from %s", self.client_address[0])
            self._json(401, {"error": "admin token not accepted"})
            return False
        return True

    def _may_view(self) -> bool:
        return self.app.view_without_token or self._authorized("view this migration")

    def _events(self) -> None:
        """Server-sent events: a snapshot at once, then on every transition or heartbeat."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-store")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        controller, after = self.app.controller, -1
        app = self.app
        with app.streaming():
            self._stream_states(app, controller, after)

    def _stream_states(self, app: Any, controller: Any, after: int) -> None:
        try:
            while not app.stopping.is_set():
                if after >= 0:
                    rows = controller.wait_for_audit(after, timeout=app.heartbeat_s)
                    after = rows[-1].id if rows else after
                if app.stopping.is_set():
                    return
                state = app.state()
                audit = state["status"]["recent_audit"]
                after = max(after, int(audit[-1]["id"]) if audit else 0)
                self.wfile.write(b"event: state\ndata: " + json.dumps(state).encode() + b"\n\n")
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError, OSError):
            return  # the page went away

    def _json(self, code: int, payload: dict[str, Any]) -> None:
        self._send(code, json.dumps(payload).encode(), "application/json")

    def _send(self, code: int, body: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Security-Policy", "default-src 'self'; img-src 'self' data:")
        self.end_headers()
        self.wfile.write(body)
