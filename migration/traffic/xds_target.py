"""The controller's target when real data planes carry the traffic (Envoy, proxyless gRPC).

A stage goes out over xDS as one version: its weights to every data plane, its placements
and rate-limit shares to every follower of the controller (each spine replica, each layered
rate limiter; `migration.xds.followers`). The stage counts as applied once every connected
data plane has ACKed its weights (at least `min_data_planes` of them) AND every connected
follower has applied and ACKed its assignment (at least `min_spine_replicas` spine
replicas). The gates read each side's own metrics through a `MetricsSource` — a Prometheus
server's PromQL in production, a direct scrape of every endpoint of each side locally.
Each gateway's health (`EndpointHealth`) marks its endpoint UNHEALTHY while it is not
SERVING, so data planes stop picking it.
The parity gate reads the shadow comparisons the spine exports (it mirrors a share of
its own answers to the layered side: `runtime.shadow.gateway_mirror`).
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
                 endpoint_health: EndpointHealth | None = None, min_data_planes: int = 1,
                 min_spine_replicas: int = 1) -> None:
        self.plane = plane
        self.metrics = metrics
        self.endpoint_health = endpoint_health
        # A stage is applied once every connected data plane ACKed it AND at least this many
        # did: with nobody connected, "everyone ACKed" is vacuously true and means nothing.
        self.min_data_planes = min_data_planes
        # Likewise for the spine replicas that must hold the stage's placements.
        self.min_spine_replicas = min_spine_replicas

    def apply(self, spine_weight: float, placements: dict[str, str], version: str, *,
              route_header: bool) -> None:
        self.plane.set_stage(spine_weight, placements, version, route_header=route_header)
        local = [name for name, where in sorted(placements.items()) if where == "local"]
        log.info("published %s: spine %.2f%%, spine placements local: %s, x-spine-route %s", version,
                 spine_weight, ", ".join(local) or "none", "honoured" if route_header else "ignored")

    def stand_by(self) -> None:
        """This controller replica does not lead: its ADS server sends nothing (what it last
        sent may be stale by now), so data planes and followers reconnect to the leader."""
        self.plane.stand_by("this migration controller replica does not lead; reconnect to reach the leader")

    def lead(self) -> None:
        """This replica leads: serve ADS again (the stage it re-applies goes out next)."""
        self.plane.serve()

    def serve_stable(self) -> None:
        """Before any rollout has moved traffic (nothing published once the controller has
        re-applied what it recorded): serve the stable state, 100% layered, so a data plane
        that connects before any plan reaches a backend. Spine replicas keep their own
        placements; layered rate limiters hold the whole limit between them. No plan says
        otherwise, so `x-spine-route` forces nothing: every request goes to the layered side."""
        if self.plane.version is None:
            self.plane.set_stage(0.0, None, STABLE_VERSION, route_header=False)
            log.info("published %s: 100%% layered, x-spine-route ignored (no rollout has started)",
                     STABLE_VERSION)

    def window_stats(self, since: float) -> tuple[WindowStats, WindowStats, ParityStats]:
        return self.metrics.window("layered", since), self.metrics.window("spine", since), self.metrics.parity(since)

    def layout_stats(self, since: float) -> tuple[WindowStats, WindowStats]:
        """Each side's requests since `since`, without the parity (what the dashboard shows)."""
        return self.metrics.window("layered", since), self.metrics.window("spine", since)

    def shadow(self) -> ShadowCapability:
        """Shadow is on when the metrics source finds the spine's comparison counters."""
        return self.metrics.shadow_exported()

    def applied(self, version: str) -> bool:
        return (self.plane.stage_acked(version, self.min_data_planes)
                and self.plane.followers_applied(version, self.min_spine_replicas))

    def data_planes(self) -> list[dict[str, object]]:
        return self.plane.status()

    def followers(self) -> list[dict[str, object]]:
        return self.plane.followers_status()

    def close(self) -> None:
        self.metrics.close()
        if self.endpoint_health is not None:
            self.endpoint_health.stop()
        self.plane.stop()
