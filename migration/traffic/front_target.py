"""The controller's `TrafficTarget` on one machine: the built-in front, the spine, data planes over xDS.

`Cutover` (`cutover.py`) starts the processes; this is what the controller moves through
them at each stage: the front's weight, the spine's placements (directly, or over ADS to a
spine process and its ACK), and each side's share of every rate limit.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from migration.gates import ParityStats, WindowStats
from migration.limit_shares import side_shares
from migration.metrics.source import MetricsSource
from migration.target import ShadowCapability
from migration.traffic.front import Front
from migration.xds import XdsControlPlane
from runtime.running_stack import RunningStack
from services.pipeline.interface import CallOptions
from services.ratelimit.api import RATELIMIT, RateLimit
from services.registry import MIDDLEWARES


class FrontTarget:
    """The controller's `TrafficTarget`: the built-in front, the spine, and data planes over xDS.

    Limits hold across the split: while the spine shares the layered rate-limit process
    (ratelimit placed remote) that one process decides for both sides; once the spine has
    its own, each side enforces its weight's share of every limit, so a tenant's total
    never exceeds its configured limit wherever its sessions land.

    `spine`: a `RunningStack` in this process, moved directly; None when the spine is a process of
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

    def __init__(self, front: Front, spine: RunningStack | None, layered_ratelimit: RateLimit | None = None,
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
            if own:  # through its interface, as to any limiter
                self.spine.component(RATELIMIT).set_share(spine_share, CallOptions(timeout=1.0))
            self._set_layered_share(layered_share)
            # The front and the xDS data planes honour `x-spine-route` as the plan says.
            self.front.honour_route_header(route_header)
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
        self.front.honour_route_header(route_header)
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
            self.layered_ratelimit.set_share(share, CallOptions(timeout=1.0))
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
                            p50_ms=layered.p50_ms,
                            latency_samples_ms=layered.ok_latencies_ms),
                WindowStats(spine.requests, spine.errors, spine.p99_ms, spine.ok_requests, p50_ms=spine.p50_ms,
                            latency_samples_ms=spine.ok_latencies_ms))

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
