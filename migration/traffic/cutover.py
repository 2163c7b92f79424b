"""A whole migration on one machine: layered stack, spine, front, controller.

The layered stack runs every component in its own process. The spine shares those
processes for whatever it has not collapsed yet (so a remote placement in the spine is
the very process the layered side uses), and builds local copies for what it has. The
front splits traffic by the controller's weight; the controller reads the front's
windows and moves placements in the spine without a restart: directly when the spine is a
`Stack` in this process (tests reach into it), over ADS when it is a process of its own
(`spine_process`, what `make run` does: `SpineProcess` follows the stages like any replica).

With `shadow.share` > 0 the front mirrors that share of answered requests to the other
side and serves its comparison counters on its own /metrics (`front_metrics_address`);
the parity gate reads them there through a `ScrapeSource`, the same code and arithmetic
as a direct scrape of spines behind Envoy. Without shadow, a plan with a parity gate is
refused (`FrontTarget.shadow`).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from migration.metrics.scrape import ScrapeSource
from migration.server import ControllerProcess
from migration.traffic.endpoint_health import EndpointHealth, endpoint
from migration.traffic.front import Front
from migration.traffic.front_target import FrontTarget
from migration.traffic.layered_process import LayeredProcess
from migration.traffic.spine_process import SpineProcess
from migration.xds import XdsControlPlane
from migration.xds.snapshot import HTTP_SUFFIX, Endpoint
from monolith.device import DeviceContext
from runtime.config.file import SpineConfig, internal_key, placements_for
from runtime.config.sections import TlsConfig
from runtime.faults import FaultHook, FaultSwitch, WrongAnswers
from runtime.http.server import start_http
from runtime.processes.run_dir import write_private
from runtime.server import RunningServer, free_port, request_pool, request_threads, start_server
from runtime.stack import Stack
from services.common.prometheus_http import PrometheusHTTPServer
from services.ratelimit.api import RATELIMIT
from services.registry import COMPONENTS, DEFAULT, GATEWAY, MIDDLEWARES


@dataclass
class Cutover:
    config: SpineConfig
    run_dir: Path
    listen: str = "127.0.0.1:0"
    xds_listen: str | None = None  # e.g. "127.0.0.1:0": serve ADS so Envoy/proxyless clients follow
    # The front's HTTP API (OpenAI/Anthropic-compatible, `runtime.http`), split like its
    # gRPC traffic; None: gRPC only. Both sides then serve HTTP too, and the xDS snapshot
    # routes an HTTP listener between them (`layered-http`, `spine-http`) by the same weights.
    http_listen: str | None = None
    front_http: Any = None
    _front_http_app: Any = None
    # The layered stack as its own process tree (`spine up --layout layered`), as in
    # production, rather than a Stack in this process (its gateway then shares this
    # interpreter with the spine's model): what `make run` compares. In-process, tests can
    # reach into it (`layered.supervisor`).
    layered_process: bool = False
    # The spine as its own process (`SpineProcess`), following the stages over ADS (an xDS
    # control plane is started for it, on `xds_listen` or any free loopback port), rather
    # than a Stack in this process: what `make run` compares. Faults: `switch_fault`.
    spine_process: bool = False
    fault: FaultHook = field(default_factory=FaultHook)  # the in-process spine's
    layered: Stack | None = None
    layered_tree: LayeredProcess | None = None  # with layered_process
    spine: Stack | None = None  # without spine_process
    spine_tree: SpineProcess | None = None  # with spine_process
    front: Front | None = None
    front_server: RunningServer | None = None
    controller: ControllerProcess | None = None
    xds: XdsControlPlane | None = None
    target: FrontTarget | None = None
    endpoint_health: EndpointHealth | None = None
    front_metrics: PrometheusHTTPServer | None = None  # the front's shadow counters, with shadow on
    parity: ScrapeSource | None = None  # what the parity gate reads them with
    admin_token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    # The controller's dashboard (`migration.dashboard`), e.g. "127.0.0.1:0"; None: none.
    dashboard_listen: str | None = None

    def start(self) -> str:
        """Start both layouts, the front and the controller; the front's address."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if internal_key(self.config) is None:  # the front and both sides share one, made for this run
            self.config = self.config.with_overrides({"internal": {"secret": secrets.token_urlsafe(32)}})
        try:
            tls = self.config.tls  # every TCP listener and link of the run speaks it
            layered_address, shared, layered_ratelimit = self._start_layered()
            spine_address = self._start_spine(layered_address, shared, tls)
            shadow = self.config.shadow
            self.front = Front({"layered": layered_address, "spine": spine_address},
                               shadow=shadow if shadow.share > 0 else None, internal_key=internal_key(self.config),
                               tls=tls)
            if self.front.shadow is not None:
                self.front_metrics = PrometheusHTTPServer(self.front.shadow.counters.registry)
                self.front_metrics.start()
                self.parity = ScrapeSource({"front": [f"http://{self.front_metrics.address}/metrics"]},
                                           interval_s=0.25)
            limits = self.config.limits
            # Sized like the gateways behind it: requests wait in the model's priority queue.
            self.front_server = start_server([(GATEWAY, self.front)], self.listen,
                                             max_message_bytes=limits.max_message_bytes, tls=tls,
                                             **request_pool(self.config.inference))
            if self.http_listen is not None:
                front = self.front
                config = self.config
                self.front_http, self._front_http_app = start_http(
                    front, config.http, config.router, config.limits, request_threads(config.inference),
                    self.http_listen, layout=lambda: "front",
                    serving=lambda: any(front.healthy.values()), tls=tls)
            if self.xds is None and self.xds_listen is not None:
                self.xds = XdsControlPlane("spine-gateway", {
                    "layered": [endpoint(layered_address)], "spine": [endpoint(spine_address)]})
                self.xds.start(self.xds_listen, tls)
            if self.xds is not None:
                self.xds.set_endpoints(self._http_endpoints())
            # Each side's gateway health (SERVING only while its fail-closed components are)
            # steers the front and the xDS endpoints.
            self.endpoint_health = EndpointHealth(
                {"layered": [layered_address], "spine": [spine_address]},
                front=self.front, xds=self.xds, tls=tls).start()
            token_file = write_private(self.run_dir, "admin-token", self.admin_token)
            token_file.chmod(0o600)
            self.target = FrontTarget(self.front, self.spine, layered_ratelimit, self.xds, self.parity)
            self.controller = ControllerProcess(str(self.run_dir / "migration.sqlite"),
                                                f"unix:{self.run_dir / 'controller.sock'}", self.admin_token,
                                                self.target, tick_s=0.1, dashboard_listen=self.dashboard_listen,
                                                view_without_token=True)
            self.controller.start()
        except BaseException:
            self.stop()
            raise
        return self.front_server.address

    def _http_endpoints(self) -> dict[str, list[Endpoint]]:
        """Each side's HTTP API as the xDS cluster `<side>-http` (none where a side serves none)."""
        addresses = {
            "layered": self.layered.http_address if self.layered is not None else (
                self.layered_tree.http_address if self.layered_tree is not None else None),
            "spine": self.spine.http_address if self.spine is not None else (
                self.spine_tree.http_address if self.spine_tree is not None else None),
        }
        return {f"{side}{HTTP_SUFFIX}": [endpoint(address)] for side, address in addresses.items() if address}

    def _start_spine(self, layered_address: str, shared: dict[str, str], tls: TlsConfig | None) -> str:
        """The spine, on the layered stack's middlewares and its own model: its address."""
        if self.spine_process:
            # It follows the stages over ADS. It is started before the control plane: a child
            # is forked, and no gRPC server thread of this process should be running then
            # (gRPC's fork handlers complain, and a lock held by one would stay held in the
            # child until its exec). So the control plane's port is chosen first; the spine
            # connects once it listens, and its endpoint joins once it has said where it serves.
            host, port = (self.xds_listen or "127.0.0.1:0").rsplit(":", 1)
            listen = f"{host}:{free_port() if port == '0' else port}"
            self.spine_tree = SpineProcess(self.config, self.run_dir / "spine", controller=listen, remote=shared)
            address = self.spine_tree.start()
            self.xds = XdsControlPlane("spine-gateway", {"layered": [endpoint(layered_address)],
                                                         "spine": [endpoint(address)]})
            self.xds.start(listen, tls)
            return address
        placements = {name: "remote" for name in MIDDLEWARES} | {"inference": "local"}
        # The spine's model behind the parity fault's switch (`fault.wrong_answers`).
        device = DeviceContext.for_section(self.config.device)
        model = WrongAnswers(DEFAULT["inference"].build(self.config, device, self.run_dir), self.fault)
        self.spine = Stack(self.config, placements, run_dir=self.run_dir / "spine", hooks=[self.fault],
                           remote_addresses=shared, device=device, servicers={"inference": model},
                           http_listen=self._side_http())
        self.spine.start()
        return self.spine.address

    def switch_fault(self, command: str) -> dict[str, Any]:
        """Switch the spine's fault (`FaultSwitch`'s commands: `error-rate R`, `wrong-answers
        on|off`, `clear`) wherever it runs; the fault now, or FaultNotSwitched / ValueError."""
        if self.spine_tree is not None:
            return self.spine_tree.switch_fault(command)
        answer = FaultSwitch(self.fault, lambda _: None).apply(command)
        if answer["event"] != "fault":
            raise ValueError(f"{command!r}: {answer['why']}")
        return answer

    def _start_layered(self) -> tuple[str, dict[str, str], Any]:
        """The layered stack, in this process or its own: its gateway's address, its
        middlewares' addresses (the spine's remote placements) and its rate limiter."""
        if self.layered_process:
            self.layered_tree = LayeredProcess(self.config, self.run_dir / "layered")
            address = self.layered_tree.start()
            return address, self.layered_tree.component_addresses(), self.layered_tree.ratelimit()
        self.layered = Stack(self.config, placements_for("layered", self.config), run_dir=self.run_dir / "layered",
                             http_listen=self._side_http())
        self.layered.start()
        assert self.layered.supervisor is not None
        shared = {name: child.address for name, child in self.layered.supervisor.children.items()
                  if name != "inference"}
        return self.layered.address, shared, self.layered.component(RATELIMIT)

    def _side_http(self) -> str | None:
        """Where an in-process side serves HTTP: anywhere on loopback when the run serves HTTP."""
        return "127.0.0.1:0" if self.http_listen is not None else None

    @property
    def address(self) -> str:
        assert self.front_server is not None
        return self.front_server.address

    @property
    def http_address(self) -> str | None:
        """The front's HTTP API (None without `http_listen`)."""
        return self.front_http.address if self.front_http is not None else None

    @property
    def front_metrics_address(self) -> str | None:
        """Where the front serves its shadow comparison counters (None with shadow off)."""
        return self.front_metrics.address if self.front_metrics is not None else None

    @property
    def controller_address(self) -> str:
        return f"unix:{self.run_dir / 'controller.sock'}"

    def stop(self) -> None:
        if self.controller is not None:
            self.controller.stop()
            self.controller = None
        if self.parity is not None:
            self.parity.close()
            self.parity = None
        if self.endpoint_health is not None:
            self.endpoint_health.stop()
            self.endpoint_health = None
        if self.xds is not None:
            self.xds.stop()
            self.xds = None
        if self.front_http is not None:
            self.front_http.stop(2.0)
            self.front_http = None
        if self._front_http_app is not None:
            self._front_http_app.close()
            self._front_http_app = None
        if self.front_server is not None:
            self.front_server.stop(2.0)
            self.front_server = None
        if self.front is not None:
            self.front.close()
            self.front = None
        if self.front_metrics is not None:
            self.front_metrics.stop()
            self.front_metrics = None
        if self.spine_tree is not None:
            self.spine_tree.stop()
            self.spine_tree = None
        for stack in (self.spine, self.layered):
            if stack is not None:
                stack.stop()
        self.spine = self.layered = None
        if self.layered_tree is not None:
            self.layered_tree.stop()
            self.layered_tree = None


__all__ = ["COMPONENTS", "Cutover"]
