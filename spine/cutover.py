"""A whole migration on one machine: layered stack, spine, front, controller.

The layered stack runs every component in its own process. The spine shares those
processes for whatever it has not collapsed yet (so a remote placement in the spine is
the very process the layered side uses), and builds local copies for what it has. The
front splits traffic by the controller's weight; the controller reads the front's
windows and moves placements in the spine without a restart.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from migration.gates import WindowStats
from migration.runner import ControllerProcess
from services.gateway_limits import RequestLimits
from spine.components import COMPONENTS, GATEWAY, MIDDLEWARES
from spine.config import placements_for
from spine.faults import FaultHook
from spine.front import Front
from spine.runtime import Stack
from spine.server import RunningServer, start_server


class FrontTarget:
    """The controller's `TrafficTarget` for the built-in front and the spine."""

    def __init__(self, front: Front, spine: Stack) -> None:
        self.front = front
        self.spine = spine
        self._lock = threading.Lock()

    def apply(self, spine_weight: float, placements: dict[str, str], version: str) -> None:
        with self._lock:
            self.spine.set_placements({name: placements[name] for name in MIDDLEWARES if name in placements})
            self.front.set_weight(spine_weight)

    def window_stats(self, since: float) -> tuple[WindowStats, WindowStats, int]:
        window = self.front.window(since)
        layered, spine = window["layered"], window["spine"]
        return (WindowStats(layered.requests, layered.errors, layered.p99_ms),
                WindowStats(spine.requests, spine.errors, spine.p99_ms), 0)

    def applied(self, version: str) -> bool:
        return True  # the front applies a weight at once


@dataclass
class Cutover:
    config: Mapping[str, Any]
    run_dir: Path
    listen: str = "127.0.0.1:0"
    fault: FaultHook = field(default_factory=FaultHook)
    layered: Stack | None = None
    spine: Stack | None = None
    front: Front | None = None
    front_server: RunningServer | None = None
    controller: ControllerProcess | None = None
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
            self.front = Front({"layered": self.layered.address, "spine": self.spine.address})
            limits = RequestLimits.from_config(self.config)
            self.front_server = start_server([(GATEWAY, self.front)], self.listen,
                                             max_message_bytes=limits.max_message_bytes)
            token_file = self.run_dir / "admin-token"
            token_file.write_text(self.admin_token)
            token_file.chmod(0o600)
            self.controller = ControllerProcess(str(self.run_dir / "migration.sqlite"),
                                                f"unix:{self.run_dir / 'controller.sock'}", self.admin_token,
                                                FrontTarget(self.front, self.spine), tick_s=0.1)
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


__all__ = ["COMPONENTS", "Cutover", "FrontTarget"]
