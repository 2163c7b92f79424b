"""A migration from a foreign HTTP endpoint to the spine on one machine: the HTTP front and the controller.

The legacy endpoint (LiteLLM's proxy, say) and the spine are already running, each its own
process; this starts what moves traffic between them: the HTTP front on `listen` (clients
call it instead of the legacy endpoint), its shadow comparisons on a /metrics of their own
(what the parity gate reads, through a `ScrapeSource`), and the migration controller with a
`LegacyTarget` (sqlite state, the `MigrationControl` API on a unix socket behind an admin
token). `python -m migration.runner --target legacy-http` runs the same parts as a service.

`LegacyCutover` says what to run; `start()` returns a `RunningLegacyCutover`, started and
stopped as the built-in cutover's parts are (`cutover_parts`: one `ExitStack`, stopped in the
reverse of the order it started, what started before a part that fails stopped at once).
"""

from __future__ import annotations

import secrets
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from migration.legacy_endpoint import LegacyEndpoint
from migration.server import ControllerProcess
from migration.traffic.cutover_parts import controller_address, serve_comparisons, start_controller
from migration.traffic.http_front import HttpFront
from migration.traffic.http_mirror import MirrorSettings
from migration.traffic.legacy_target import LegacyTarget
from runtime.config.http import HttpConfig
from runtime.http.server import HttpServer
from runtime.running_parts import RunningParts
from services.common.prometheus_http import PrometheusHTTPServer


@dataclass(frozen=True)
class LegacyCutover:
    """What a migration from a foreign HTTP endpoint runs; `start()` runs it."""

    legacy: LegacyEndpoint
    spine_http: str  # the spine's HTTP API, e.g. http://127.0.0.1:8000
    run_dir: Path
    listen: str = "127.0.0.1:0"
    mirror: MirrorSettings | None = None
    # The spine's internal secret: the front marks its shadow copies with it.
    internal_key: bytes | None = field(default=None, repr=False)
    http: HttpConfig = field(default_factory=HttpConfig)
    timeout_s: float = 300.0
    tick_s: float = 0.1
    dashboard_listen: str | None = None
    admin_token: str = field(default_factory=lambda: secrets.token_urlsafe(24), repr=False)

    def start(self) -> RunningLegacyCutover:
        """Start the front and the controller; what runs. Should one fail to start, what
        started before it is stopped and the error raised."""
        self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        with ExitStack() as parts:  # left by an error: it stops what had started
            front = HttpFront(self.legacy, self.spine_http, mirror=self.mirror, internal_key=self.internal_key,
                              http=self.http, timeout_s=self.timeout_s)
            server = HttpServer(front, front.http, self.listen).start()
            parts.callback(server.stop, 2.0)
            # Its copies in flight finish and its connections close on the server's loop, so before the server stops.
            parts.callback(front.close)
            comparisons = serve_comparisons(parts, front.mirror.counters.registry) if front.mirror is not None else None
            target = LegacyTarget(front, comparisons.parity if comparisons is not None else None)
            controller = start_controller(parts, self.run_dir, self.admin_token, target, tick_s=self.tick_s,
                                          dashboard_listen=self.dashboard_listen)
            return RunningLegacyCutover(
                legacy=self.legacy, run_dir=self.run_dir, front=front, server=server,
                metrics=comparisons.metrics if comparisons is not None else None, target=target,
                controller=controller,
                parts=parts.pop_all())  # last: the running cutover holds the stops from here on


@dataclass(frozen=True)
class RunningLegacyCutover(RunningParts):
    """A started `LegacyCutover`: its front (`metrics` None without a mirror) and its controller."""

    legacy: LegacyEndpoint
    run_dir: Path
    front: HttpFront
    server: HttpServer
    metrics: PrometheusHTTPServer | None
    target: LegacyTarget
    controller: ControllerProcess

    @property
    def address(self) -> str:
        """The front's HOST:PORT."""
        return self.server.address

    @property
    def base_url(self) -> str:
        """What the openai SDK takes (`/v1` appended)."""
        return f"http://{self.address}/v1"

    @property
    def controller_address(self) -> str:
        return controller_address(self.run_dir)
