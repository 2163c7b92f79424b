"""A whole migration on one machine: layered stack, spine, front, controller.

The layered stack runs every component in its own process. The spine shares those
processes for whatever it has not collapsed yet (so a remote placement in the spine is
the very process the layered side uses), and builds local copies for what it has. The
front splits traffic by the controller's weight; the controller reads the front's
windows and moves placements in the spine without a restart.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from migration.gates import WindowStats
from migration.runner import ControllerProcess
from migration.traffic.front import Front
from migration.traffic.shadow import ShadowConfig
from migration.xds import Endpoint, XdsControlPlane
from services.pipeline.verdicts import RequestLimits
from services.registry import COMPONENTS, GATEWAY, MIDDLEWARES
from spine.runtime.config import placements_for
from spine.runtime.faults import FaultHook
from spine.runtime.health import check_serving
from spine.runtime.server import RunningServer, request_pool, start_server
from spine.runtime.stack import Stack
from spine.v1 import ratelimit_pb2

# A side that gets no traffic still keeps a sliver of budget: a share must be > 0, and
# requests forced to that side (x-spine-route) or still in flight are few.
MIN_SHARE = 0.01


class FrontTarget:
    """The controller's `TrafficTarget`: the built-in front, the spine, and data planes over xDS.

    Limits hold across the split: while the spine shares the layered rate-limit process
    (ratelimit placed remote) that one process decides for both sides; once the spine has
    its own, each side enforces its weight's share of every limit, so a tenant's total
    never exceeds its configured limit wherever its sessions land.
    """

    def __init__(self, front: Front, spine: Stack, layered_ratelimit: Any | None = None,
                 xds: XdsControlPlane | None = None) -> None:
        self.front = front
        self.spine = spine
        self.layered_ratelimit = layered_ratelimit
        self.xds = xds
        self._lock = threading.Lock()

    def apply(self, spine_weight: float, placements: dict[str, str], version: str) -> None:
        with self._lock:
            self.spine.set_placements({name: placements[name] for name in MIDDLEWARES if name in placements})
            self._split_limits(spine_weight)
            self.front.set_weight(spine_weight)
            if self.xds is not None:
                self.xds.set_spine_percent(spine_weight, version)

    def _split_limits(self, spine_weight: float) -> None:
        spine_share = spine_weight / 100.0
        own = self.spine.placements.get("ratelimit") == "local"
        if own:
            self.spine.local_servicers["ratelimit"].set_share(max(spine_share, MIN_SHARE))
        if self.layered_ratelimit is not None:
            layered_share = max(1.0 - spine_share, MIN_SHARE) if own else 1.0
            self.layered_ratelimit.SetShare(ratelimit_pb2.SetShareRequest(fraction=layered_share), timeout=1.0)

    def window_stats(self, since: float) -> tuple[WindowStats, WindowStats, int]:
        window = self.front.window(since)
        layered, spine = window["layered"], window["spine"]
        return (WindowStats(layered.requests, layered.errors, layered.p99_ms),
                WindowStats(spine.requests, spine.errors, spine.p99_ms),
                self.front.parity_mismatches(since))  # shadow mismatches not explained by noise

    def data_planes(self) -> list[dict[str, Any]]:
        """What each xDS data plane ACKed or NACKed (shown by `spine migrate status`)."""
        return self.xds.status() if self.xds is not None else []

    def applied(self, version: str) -> bool:
        """The front applies a weight at once; xDS data planes once they have ACKed it."""
        return self.xds is None or self.xds.stage_acked(version)


class EndpointHealth:
    """Watches each side's deep health and tells the front (which fails over and counts the
    failure against that side, so the gates roll back) and xDS (which sends the side as an
    unhealthy endpoint, so data planes stop picking it)."""

    def __init__(self, front: Front, xds: XdsControlPlane | None, addresses: Mapping[str, str],
                 interval_s: float = 0.5) -> None:
        self.front = front
        self.xds = xds
        self.addresses = dict(addresses)
        self.interval_s = interval_s
        self.healthy: dict[str, bool] = dict.fromkeys(addresses, True)
        self._channels = {side: grpc.insecure_channel(address) for side, address in addresses.items()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="endpoint-health", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def check_once(self) -> dict[str, bool]:
        now = {side: check_serving(channel, timeout=self.interval_s) is True
               for side, channel in self._channels.items()}
        if now != self.healthy:
            self.healthy = now
            self.front.healthy = dict(now)
            if self.xds is not None:
                self.xds.set_endpoints({side: [_endpoint(self.addresses[side], now[side])] for side in now})
        return now

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check_once()
            except Exception:  # keep watching; the next round retries
                logging.getLogger("spine.cutover").exception("endpoint health check failed")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for channel in self._channels.values():
            channel.close()


@dataclass
class Cutover:
    config: Mapping[str, Any]
    run_dir: Path
    listen: str = "127.0.0.1:0"
    xds_listen: str | None = None  # e.g. "127.0.0.1:0": serve ADS so Envoy/proxyless clients follow
    fault: FaultHook = field(default_factory=FaultHook)
    layered: Stack | None = None
    spine: Stack | None = None
    front: Front | None = None
    front_server: RunningServer | None = None
    controller: ControllerProcess | None = None
    xds: XdsControlPlane | None = None
    target: FrontTarget | None = None
    endpoint_health: EndpointHealth | None = None
    admin_token: str = field(default_factory=lambda: secrets.token_urlsafe(24))

    def start(self) -> str:
        """Start both layouts, the front and the controller; the front's address."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.layered = Stack(self.config, placements_for("layered", self.config), run_dir=self.run_dir / "layered")
            self.layered.start()
            assert self.layered.supervisor is not None
            shared = {name: child.address for name, child in self.layered.supervisor.children.items()
                      if name != "inference"}
            placements = {name: "remote" for name in MIDDLEWARES} | {"inference": "local"}
            self.spine = Stack(self.config, placements, run_dir=self.run_dir / "spine", hooks=[self.fault],
                               remote_addresses=shared)
            self.spine.start()
            shadow = ShadowConfig.from_config(self.config)
            self.front = Front({"layered": self.layered.address, "spine": self.spine.address},
                               shadow=shadow if shadow.share > 0 else None)
            limits = RequestLimits.from_config(self.config)
            # Sized like the gateways behind it: requests wait in the model's priority queue.
            self.front_server = start_server([(GATEWAY, self.front)], self.listen,
                                             max_message_bytes=limits.max_message_bytes,
                                             **request_pool(self.config))
            if self.xds_listen is not None:
                self.xds = XdsControlPlane("spine-gateway", {
                    "layered": [_endpoint(self.layered.address)], "spine": [_endpoint(self.spine.address)]})
                self.xds.start(self.xds_listen)
            self.endpoint_health = EndpointHealth(
                self.front, self.xds, {"layered": self.layered.address, "spine": self.spine.address})
            self.endpoint_health.start()
            layered_ratelimit = self.layered.bindings.get("ratelimit")
            token_file = self.run_dir / "admin-token"
            token_file.write_text(self.admin_token)
            token_file.chmod(0o600)
            self.target = FrontTarget(self.front, self.spine, layered_ratelimit, self.xds)
            self.controller = ControllerProcess(str(self.run_dir / "migration.sqlite"),
                                                f"unix:{self.run_dir / 'controller.sock'}", self.admin_token,
                                                self.target, tick_s=0.1)
            self.controller.start()
        except BaseException:
            self.stop()
            raise
        return self.front_server.address

    @property
    def address(self) -> str:
        assert self.front_server is not None
        return self.front_server.address

    @property
    def controller_address(self) -> str:
        return f"unix:{self.run_dir / 'controller.sock'}"

    def stop(self) -> None:
        if self.controller is not None:
            self.controller.stop()
            self.controller = None
        if self.endpoint_health is not None:
            self.endpoint_health.stop()
            self.endpoint_health = None
        if self.xds is not None:
            self.xds.stop()
            self.xds = None
        if self.front_server is not None:
            self.front_server.stop(2.0)
            self.front_server = None
        if self.front is not None:
            self.front.close()
            self.front = None
        for stack in (self.spine, self.layered):
            if stack is not None:
                stack.stop()
        self.spine = self.layered = None


def _endpoint(address: str, healthy: bool = True) -> Endpoint:
    host, _, port = address.rpartition(":")
    return Endpoint(host, int(port), healthy)


__all__ = ["COMPONENTS", "Cutover", "FrontTarget"]
