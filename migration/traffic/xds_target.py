"""The controller's target when real data planes carry the traffic (Envoy, proxyless gRPC).

Weights go out over xDS; a stage counts as applied once every connected data plane has
ACKed its version; the gates read each side's own Prometheus metrics. Each gateway's health
(`EndpointHealth`) marks its endpoint UNHEALTHY while it is not SERVING, so data planes
stop picking it. Placements are the
spine's own configuration in this mode (a spine Deployment runs with its middlewares
collapsed); the controller records them with each stage but has no process to move them
in — the built-in front (`migration.traffic.cutover`) is the mode that moves placements live.
"""

from __future__ import annotations

import logging
import threading

from migration.gates import WindowStats
from migration.prometheus_window import PrometheusWindow
from migration.traffic.endpoint_health import EndpointHealth
from migration.xds import XdsControlPlane

log = logging.getLogger("spine.migration.xds_target")
STABLE_VERSION = "stable"


class XdsTarget:
    def __init__(self, plane: XdsControlPlane, layered: PrometheusWindow, spine: PrometheusWindow,
                 scrape_interval_s: float = 0.5, endpoint_health: EndpointHealth | None = None) -> None:
        self.plane = plane
        self.endpoint_health = endpoint_health
        self.layered = layered
        self.spine = spine
        self._stop = threading.Event()
        self._scraper = threading.Thread(target=self._scrape_loop, args=(scrape_interval_s,),
                                         name="prometheus-scrape", daemon=True)
        self._scraper.start()

    def apply(self, spine_weight: float, placements: dict[str, str], version: str) -> None:
        self.plane.set_spine_percent(spine_weight, version)
        log.info("published %s: spine %.2f%% (placements %s are the spine's own config in xds mode)",
                 version, spine_weight, placements)

    def serve_stable(self) -> None:
        """Before any rollout has moved traffic (nothing published once the controller has
        re-applied what it recorded): serve the stable state, 100% layered, so a data plane
        that connects before any plan reaches a backend."""
        if self.plane.version is None:
            self.plane.set_spine_percent(0.0, STABLE_VERSION)
            log.info("published %s: 100%% layered (no rollout has started)", STABLE_VERSION)

    def window_stats(self, since: float) -> tuple[WindowStats, WindowStats, int]:
        return self.layered.window(since), self.spine.window(since), 0

    def applied(self, version: str) -> bool:
        return self.plane.stage_acked(version)

    def data_planes(self) -> list[dict[str, object]]:
        return self.plane.status()

    def _scrape_loop(self, interval_s: float) -> None:
        """Keep snapshots coming, so every window has a baseline near its start."""
        while not self._stop.wait(interval_s):
            for side in (self.layered, self.spine):
                try:
                    side.scrape()
                except OSError as error:
                    log.warning("cannot scrape %s: %s", side.url, error)

    def close(self) -> None:
        self._stop.set()
        if self.endpoint_health is not None:
            self.endpoint_health.stop()
        self.plane.stop()
