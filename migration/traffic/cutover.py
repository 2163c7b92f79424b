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
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from migration.gates import ParityStats, WindowStats
from migration.limits import side_shares
from migration.metrics.scrape import ScrapeSource
from migration.metrics.source import MetricsSource
from migration.server import ControllerProcess
from migration.target import ShadowCapability
from migration.traffic.endpoint_health import EndpointHealth, endpoint
from migration.traffic.front import Front
from migration.traffic.layered_process import LayeredProcess
from migration.traffic.spine_process import SpineProcess
from migration.xds import XdsControlPlane
from migration.xds.snapshot import HTTP_SUFFIX, Endpoint
from monolith.device import DeviceContext
from runtime.config import internal_key, merge, placements_for
from runtime.faults import FaultHook, FaultSwitch, WrongAnswers
from runtime.http.server import start_http
from runtime.run_dir import write_private
from runtime.sections import TlsConfig
from runtime.server import RunningServer, free_port, request_pool, start_server
from runtime.shadow import ShadowConfig
from runtime.stack import Stack
from services.common.prometheus_http import PrometheusHTTPServer
from services.pipeline.verdicts import RequestLimits
from services.registry import COMPONENTS, DEFAULT, GATEWAY, MIDDLEWARES
from wire.v1 import ratelimit_pb2


class FrontTarget:
    """The controller's `TrafficTarget`: the built-in front, the spine, and data planes over xDS.

    Limits hold across the split: while the spine shares the layered rate-limit process
    (ratelimit placed remote) that one process decides for both sides; once the spine has
    its own, each side enforces its weight's share of every limit, so a tenant's total
    never exceeds its configured limit wherever its sessions land.

    `spine`: a `Stack` in this process, moved directly; None when the spine is a process of
    its own that follows `xds`. Then a stage reaches the spine as an assignment (placements
    and its share) that it applies and ACKs a little later, and the front's weight and the
    layered rate limiter's share (which governs the traffic the front sends that side) move
    together, on one side of that moment (`_Staged`):
    - a stage that sends the spine more traffic waits for its ACK (`applied`): a spine that
      does not hold the stage's placements yet gets none of the new traffic;
    - one that sends it less or the same goes in at once: a rollback (weight 0) waits for no
      spine, dead or stuck, and the layered side never refuses what its new share allows.
    While the spine applies the stage (milliseconds) a split tenant's total may exceed its
    limit by the difference of the two sides' old and new shares; nothing is refused that
    the limit allows. A spine that never ACKs leaves the front where it was and the stage
    unapplied: the controller's window never opens, and `spine migrate status` shows the
    follower's NACK.
    """

    def __init__(self, front: Front, spine: Stack | None, layered_ratelimit: Any | None = None,
                 xds: XdsControlPlane | None = None, parity: MetricsSource | None = None) -> None:
        if spine is None and xds is None:
            raise ValueError("a spine in its own process follows the xDS control plane: give `xds`")
        self.front = front
        self.spine = spine
        self.layered_ratelimit = layered_ratelimit
        self.xds = xds
        self.parity = parity  # reads the front's shadow counters (its /metrics)
        self._lock = threading.Lock()
        self._layered_share = 1.0  # what the layered limiter holds now (it starts with the whole limit)
        self._staged: _Staged | None = None  # a stage waiting for the spine process's ACK
        self._committed: str | None = None  # the last stage whose every part is in force

    def apply(self, spine_weight: float, placements: dict[str, str], version: str, *,
              route_header: bool) -> None:
        moved = {name: placements[name] for name in MIDDLEWARES if name in placements}
        with self._lock:
            if self.spine is None:
                self._stage_for_follower(spine_weight, moved, version, route_header)
                return
            self.spine.set_placements(moved)
            own = self.spine.placements.get("ratelimit") == "local"
            spine_share, layered_share = side_shares(spine_weight, own)
            if own:  # through its binding, as to any limiter
                self.spine.bindings["ratelimit"].SetShare(ratelimit_pb2.SetShareRequest(fraction=spine_share),
                                                          timeout=1.0)
            self._set_layered_share(layered_share)
            # The front and the xDS data planes honour `x-spine-route` as the plan says.
            self.front.route_header = route_header
            self.front.set_weight(spine_weight)
            if self.xds is not None:
                self.xds.set_spine_percent(spine_weight, version, route_header=route_header)

    def _stage_for_follower(self, spine_weight: float, placements: dict[str, str], version: str,
                            route_header: bool) -> None:
        """Publish the stage (the spine's placements and share go out with the weights); the
        front's weight and the layered share go in at once or, when the spine gets more
        traffic, once it has ACKed (class docstring)."""
        assert self.xds is not None
        _, layered_share = side_shares(spine_weight, placements.get("ratelimit") == "local")
        staged = _Staged(version, spine_weight, layered_share)
        self.xds.set_stage(spine_weight, placements, version, route_header=route_header)
        self.front.route_header = route_header
        self._staged = staged
        if spine_weight <= self.front.spine_weight:  # no more traffic for the spine: at once
            self._commit(staged)

    def _commit(self, staged: _Staged) -> None:
        """The front's side of a stage: the layered limiter's share and the weight, together."""
        self._set_layered_share(staged.layered_share)
        self.front.set_weight(staged.spine_weight)
        self._committed = staged.version
        if self._staged is staged:
            self._staged = None

    def _set_layered_share(self, share: float) -> None:
        if self.layered_ratelimit is not None and share != self._layered_share:
            self.layered_ratelimit.SetShare(ratelimit_pb2.SetShareRequest(fraction=share), timeout=1.0)
        self._layered_share = share

    def window_stats(self, since: float) -> tuple[WindowStats, WindowStats, ParityStats]:
        parity = (self.parity.parity(since) if self.parity is not None
                  else ParityStats(0, 0, missing="the front's shadow comparisons are not read"))
        return (*self.layout_stats(since), parity)

    def layout_stats(self, since: float) -> tuple[WindowStats, WindowStats]:
        """Each side's requests since `since`, without the parity (what the dashboard shows)."""
        window = self.front.window(since)
        layered, spine = window["layered"], window["spine"]
        return (WindowStats(layered.requests, layered.errors, layered.p99_ms, layered.ok_requests,
                            p50_ms=layered.p50_ms),
                WindowStats(spine.requests, spine.errors, spine.p99_ms, spine.ok_requests, p50_ms=spine.p50_ms))

    def shadow(self) -> ShadowCapability:
        mirror = self.front.shadow
        if mirror is None or mirror.share <= 0:
            return ShadowCapability(False, "the front mirrors nothing (shadow.share is 0): set shadow.share > 0 "
                                           "in the config (the internal secret signs the copies)")
        if self.parity is None:
            return ShadowCapability(False, "the front mirrors, but nothing reads its comparisons "
                                           "(FrontTarget was given no parity source)")
        return ShadowCapability(True, f"the front mirrors {mirror.share:.0%} of answered requests and "
                                      f"exports the comparisons it reads")

    def close(self) -> None:
        if self.parity is not None:
            self.parity.close()

    def data_planes(self) -> list[dict[str, Any]]:
        """What each xDS data plane ACKed or NACKed (shown by `spine migrate status`)."""
        return self.xds.status() if self.xds is not None else []

    def followers(self) -> list[dict[str, Any]]:
        """What each follower of the stages (the spine process) applied (status, dashboard)."""
        return self.xds.followers_status() if self.xds is not None else []

    def applied(self, version: str) -> bool:
        """The front applies a weight at once; xDS data planes once they have ACKed it; a
        spine in its own process once it has applied and ACKed its assignment (then the
        stage's raised share and weight go in: see the class docstring)."""
        if self.xds is None:
            return True
        if not self.xds.stage_acked(version):
            return False
        if self.spine is not None:
            return True
        with self._lock:
            staged = self._staged
            if staged is None or staged.version != version:
                return self._committed == version and staged is None
            if not self.xds.followers_applied(version, 1):
                return False
            self._commit(staged)
            return True


@dataclass(frozen=True)
class _Staged:
    """A stage published to the spine process and waiting for its ACK: what goes in then."""

    version: str
    spine_weight: float
    layered_share: float


@dataclass
class Cutover:
    config: Mapping[str, Any]
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
            self.config = merge(self.config, {"internal": {"secret": secrets.token_urlsafe(32)}})
        try:
            tls = TlsConfig.from_config(self.config)  # every TCP listener and link of the run speaks it
            layered_address, shared, layered_ratelimit = self._start_layered()
            spine_address = self._start_spine(layered_address, shared, tls)
            shadow = ShadowConfig.from_config(self.config)
            self.front = Front({"layered": layered_address, "spine": spine_address},
                               shadow=shadow if shadow.share > 0 else None, internal_key=internal_key(self.config),
                               tls=tls)
            if self.front.shadow is not None:
                self.front_metrics = PrometheusHTTPServer(self.front.shadow.counters.registry)
                self.front_metrics.start()
                self.parity = ScrapeSource({"front": [f"http://{self.front_metrics.address}/metrics"]},
                                           interval_s=0.25)
            limits = RequestLimits.from_config(self.config)
            # Sized like the gateways behind it: requests wait in the model's priority queue.
            self.front_server = start_server([(GATEWAY, self.front)], self.listen,
                                             max_message_bytes=limits.max_message_bytes, tls=tls,
                                             **request_pool(self.config))
            if self.http_listen is not None:
                front = self.front
                self.front_http, self._front_http_app = start_http(
                    front, self.config, self.http_listen, layout=lambda: "front",
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
        device = DeviceContext.from_config(self.config)
        model = WrongAnswers(DEFAULT["inference"].build(self.config, device, self.run_dir), self.fault)
        self.spine = Stack(self.config, placements, run_dir=self.run_dir / "spine", hooks=[self.fault],
                           remote_addresses=shared, device=device, local_servicers={"inference": model},
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
        return self.layered.address, shared, self.layered.bindings.get("ratelimit")

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


__all__ = ["COMPONENTS", "Cutover", "FrontTarget"]
