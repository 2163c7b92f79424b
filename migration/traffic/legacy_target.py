"""The controller's `TrafficTarget` when the from side is a foreign HTTP endpoint.

The HTTP front (`http_front`) is the whole data path: a stage is its weight (the spine
serves whole, so a stage's placements mean nothing here: the plan refuses them), applied the
moment it is set; a rollback sends every new request to the legacy endpoint. The gates judge
both sides from what the front measured, and the parity gate reads the front's shadow
comparisons from its /metrics like every other data path (`ScrapeSource`).
"""

from __future__ import annotations

from typing import Any

from migration.gates import ParityStats, WindowStats
from migration.legacy_endpoint import LegacyEndpoint
from migration.metrics.source import MetricsSource
from migration.target import ShadowCapability
from migration.traffic.http_front import HttpFront


class LegacyTarget:
    def __init__(self, front: HttpFront, parity: MetricsSource | None = None) -> None:
        self.front = front
        self.parity = parity  # reads the front's shadow counters (its /metrics)

    def legacy(self) -> LegacyEndpoint:
        """The endpoint this data path migrates from: a plan must name the same (`legacy:`)."""
        return self.front.legacy

    def apply(self, spine_weight: float, placements: dict[str, str], version: str, *,
              route_header: bool) -> None:
        self.front.honour_route_header(route_header)
        self.front.set_weight(spine_weight)

    def applied(self, version: str) -> bool:
        return True  # the front is the only data plane, and takes a weight at once

    def window_stats(self, since: float) -> tuple[WindowStats, WindowStats, ParityStats]:
        parity = (self.parity.parity(since) if self.parity is not None
                  else ParityStats(0, 0, missing="the front's shadow comparisons are not read"))
        return (*self.layout_stats(since), parity)

    def layout_stats(self, since: float) -> tuple[WindowStats, WindowStats]:
        """Each side as the front measured it: 5xx and unanswered requests are its errors."""
        window = self.front.window(since)
        legacy, spine = window["layered"], window["spine"]
        return (WindowStats(legacy.requests, legacy.errors, legacy.p99_ms, legacy.ok_requests, p50_ms=legacy.p50_ms,
                            latency_samples_ms=legacy.ok_latencies_ms),
                WindowStats(spine.requests, spine.errors, spine.p99_ms, spine.ok_requests, p50_ms=spine.p50_ms,
                            latency_samples_ms=spine.ok_latencies_ms))

    def shadow(self) -> ShadowCapability:
        mirror = self.front.mirror
        if mirror is None or mirror.share <= 0:
            return ShadowCapability(False, "the HTTP front mirrors nothing: give it a shadow share > 0")
        if self.parity is None:
            return ShadowCapability(False, "the HTTP front mirrors, but nothing reads its comparisons")
        return ShadowCapability(True, f"the HTTP front mirrors {mirror.share:.0%} of answered requests to the "
                                      f"other side and exports the comparisons")

    def data_planes(self) -> list[dict[str, Any]]:
        return []

    def followers(self) -> list[dict[str, Any]]:
        return []

    def close(self) -> None:
        if self.parity is not None:
            self.parity.close()
