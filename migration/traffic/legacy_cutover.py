"""A migration from a foreign HTTP endpoint to the spine on one machine: the HTTP front and the controller.

The legacy endpoint (LiteLLM's proxy, say) and the spine are already running, each its own
process; this starts what moves traffic between them: the HTTP front on `listen` (clients
call it instead of the legacy endpoint), its shadow comparisons on a /metrics of their own
(what the parity gate reads, through a `ScrapeSource`), and the migration controller with a
`LegacyTarget` (sqlite state, the `MigrationControl` API on a unix socket behind an admin
token). `python -m migration.runner --target legacy-http` runs the same parts as a service.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path

from migration.legacy_endpoint import LegacyEndpoint
from migration.metrics.scrape import ScrapeSource
from migration.server import ControllerProcess
from migration.traffic.http_front import HttpFront
from migration.traffic.http_mirror import MirrorSettings
from migration.traffic.legacy_target import LegacyTarget
from runtime.config.http import HttpConfig
from runtime.http.server import HttpServer
from runtime.processes.run_dir import write_private
from services.common.prometheus_http import PrometheusHTTPServer


@dataclass
class LegacyCutover:
    legacy: LegacyEndpoint
    spine_http: str  # the spine's HTTP API, e.g. http://127.0.0.1:8000
    run_dir: Path
    listen: str = "127.0.0.1:0"
    mirror: MirrorSettings | None = None
    internal_key: bytes | None = None  # the spine's internal secret: its shadow copies are marked
    http: HttpConfig = field(default_factory=HttpConfig)
    timeout_s: float = 300.0
    tick_s: float = 0.1
    dashboard_listen: str | None = None
    admin_token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    front: HttpFront | None = None
    server: HttpServer | None = None
    metrics: PrometheusHTTPServer | None = None
    target: LegacyTarget | None = None
    controller: ControllerProcess | None = None

    def start(self) -> str:
        """Start the front and the controller; the front's address (HOST:PORT)."""
        self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            self.front = HttpFront(self.legacy, self.spine_http, mirror=self.mirror, internal_key=self.internal_key,
                                   http=self.http, timeout_s=self.timeout_s)
            self.server = HttpServer(self.front, self.front.http, self.listen).start()
            parity = None
            if self.front.mirror is not None:
                self.metrics = PrometheusHTTPServer(self.front.mirror.counters.registry)
                self.metrics.start()
                parity = ScrapeSource({"front": [f"http://{self.metrics.address}/metrics"]}, interval_s=0.25)
            self.target = LegacyTarget(self.front, parity)
            write_private(self.run_dir, "admin-token", self.admin_token).chmod(0o600)
            self.controller = ControllerProcess(str(self.run_dir / "migration.sqlite"), self.controller_address,
                                                self.admin_token, self.target, tick_s=self.tick_s,
                                                dashboard_listen=self.dashboard_listen, view_without_token=True)
            self.controller.start()
        except BaseException:
            self.stop()
            raise
        return self.server.address

    @property
    def address(self) -> str:
        assert self.server is not None
        return self.server.address

    @property
    def base_url(self) -> str:
        """What the openai SDK takes (`/v1` appended)."""
        return f"http://{self.address}/v1"

    @property
    def controller_address(self) -> str:
        return f"unix:{self.run_dir / 'controller.sock'}"

    def stop(self) -> None:
        if self.controller is not None:
            self.controller.stop()
            self.controller = None
        if self.target is not None:
            self.target.close()
            self.target = None
        if self.front is not None and self.server is not None:
            self.front.close()
        if self.server is not None:
            self.server.stop(2.0)
            self.server = None
        if self.metrics is not None:
            self.metrics.stop()
            self.metrics = None
        self.front = None
