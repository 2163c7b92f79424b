"""The controller's target when real data planes carry the traffic (Envoy, proxyless gRPC).

Weights go out over xDS; a stage counts as applied once every connected data plane has
ACKed its version; the gates read each side's own metrics through a `MetricsSource` — a
Prometheus server's PromQL in production, a direct scrape of every endpoint of each side
locally — and the parity gate the shadow comparisons the spine exports (it mirrors a share
of its own answers to the layered side: `spine.runtime.gateway_mirror`). Each gateway's
health (`EndpointHealth`) marks its endpoint UNHEALTHY while it is not SERVING, so data
planes stop picking it. Placements are the spine's own configuration
in this mode (a spine Deployment runs with its middlewares collapsed); the controller
records them with each stage but has no process to move them in — the built-in front
(`migration.traffic.cutover`) is the mode that moves placements live.
"""

from __future__ import annotations

import logging

from migration.gates import ParityStats, WindowStats
from migration.metrics.source import MetricsSource
from migration.target import ShadowCapability
from migration.traffic.endpoint_health import EndpointHealth
from migration.xds import XdsControlPlane

log = logging.getLogger("spine.migration.xds_target")
STABLE_VERSION = "stable"


class XdsTarget:
    def __init__(self, plane: XdsControlPlane, metrics: MetricsSource,
                 endpoint_health: EndpointHealth | None = None, min_data_planes: int = 1) -> None:
        self.plane = plane
        self.metrics = metrics
        self.endpoint_health = endpoint_health
        # A stage is applied once every connected data plane ACKed it AND at least this many
        # did: with nobody connected, "everyone ACKed" is vacuously true and means nothing.
        self.min_data_planes = min_data_planes

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

    def window_stats(self, since: float) -> tuple[WindowStats, WindowStats, ParityStats]:
        return self.metrics.window("layered", since), self.metrics.window("spine", since), self.metrics.parity(since)

    def shadow(self) -> ShadowCapability:
        """Shadow is on when the metrics source finds the spine's comparison counters."""
        return self.metrics.shadow_exported()

    def applied(self, version: str) -> bool:
        return self.plane.stage_acked(version, self.min_data_planes)

    def data_planes(self) -> list[dict[str, object]]:
        return self.plane.status()

    def close(self) -> None:
        self.metrics.close()
        if self.endpoint_health is not None:
            self.endpoint_health.stop()
        self.plane.stop()
