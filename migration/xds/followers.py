"""What each follower of the controller is assigned at a stage, kept in the snapshot cache.

Followers are spine replicas (role "spine") and layered rate limiters (role
"layered-ratelimit"); each names its role in its xDS Node (runtime/stage_follower.py).
The ADS server tells this registry who connects and who leaves (`StreamCallbacks`); the
registry answers by setting one snapshot per follower node, holding one
`spine.v1.StageAssignment`:

- a spine replica gets the stage's placements and, while its rate limiter is local in the
  stage, the spine side's share of every limit divided by the spine replicas connected;
- a layered rate limiter gets the layered side's share divided by the layered rate
  limiters connected (the whole limit while the spine still calls them).

See `migration.limits` for the rule. Shares depend on how many followers of a role are
connected, so when one joins or leaves, every follower is republished: the stage's version
with a membership suffix ("plan#4+m1", "+m2", ...). A follower that joins late gets the
current stage at once (its snapshot is set before its first request is answered); one that
leaves drops out of the count. The stage's version stays the controller's: a stage is
applied for the followers once every connected one ACKed the current follower version
(`XdsControlPlane.followers_applied`).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from migration.limits import replica_share, side_shares
from migration.xds.cache import SnapshotCache
from migration.xds.snapshot import STAGE, Snapshot
from runtime.stage_follower import ROLE_LAYERED_RATELIMIT, ROLE_SPINE, SIDES
from services.registry import MIDDLEWARES
from wire.v1 import stage_pb2

log = logging.getLogger("spine.xds.followers")

RESOURCE_NAME = "stage"
ROLES = (ROLE_SPINE, ROLE_LAYERED_RATELIMIT)


@dataclass(frozen=True)
class FollowerStage:
    """A stage as followers see it. `placements` None: the stable state before any rollout
    (the spine keeps its own placements)."""

    version: str
    spine_weight: float
    placements: dict[str, str] | None


class StageFollowers:
    """The connected followers and their assignments; implements the ADS `StreamCallbacks`."""

    def __init__(self, cache: SnapshotCache) -> None:
        self._cache = cache
        self._lock = threading.Lock()
        self._streams: dict[int, tuple[str, str]] = {}  # stream id -> (node id, role)
        self._stage: FollowerStage | None = None
        self._republished = 0  # within the stage: how often membership changed the shares
        self._version: str | None = None
        self._assigned: dict[str, stage_pb2.StageAssignment] = {}

    # -- what the control plane calls ------------------------------------------------------

    def set_stage(self, spine_weight: float, placements: Mapping[str, str] | None, version: str) -> None:
        """Publish `version`'s assignment to every connected follower (and later joiners)."""
        kept = None if placements is None else {m: placements[m] for m in MIDDLEWARES if m in placements}
        with self._lock:
            self._stage = FollowerStage(version, spine_weight, kept)
            self._republished = 0
            self._publish_locked()

    def current_version(self, stage_version: str) -> str | None:
        """The version followers must ACK for `stage_version` to be in force; None when that
        is not the stage published last."""
        with self._lock:
            if self._stage is None or self._stage.version != stage_version:
                return None
            return self._version

    def assigned(self) -> dict[str, stage_pb2.StageAssignment]:
        """Node id -> what it was last assigned."""
        with self._lock:
            return dict(self._assigned)

    # -- StreamCallbacks ---------------------------------------------------------------------

    def node_connected(self, stream_id: int, node_id: str, role: str) -> None:
        if not role:
            return  # a data plane
        if role not in SIDES:
            log.warning("xds: node %r names role %r, which follows nothing (roles: %s); it gets no assignment",
                        node_id, role, ", ".join(ROLES))
            return
        with self._lock:
            before = self._nodes_locked()
            self._streams[stream_id] = (node_id, role)
            if self._nodes_locked() != before:
                self._membership_changed_locked()

    def node_disconnected(self, stream_id: int, node_id: str, role: str) -> None:
        with self._lock:
            if self._streams.pop(stream_id, None) is None:
                return
            nodes = self._nodes_locked()
            if node_id not in nodes:
                self._assigned.pop(node_id, None)
                self._cache.clear(node_id)
                self._membership_changed_locked()

    # -- internals -------------------------------------------------------------------------

    def _nodes_locked(self) -> dict[str, str]:
        return dict(self._streams.values())

    def _membership_changed_locked(self) -> None:
        if self._stage is None:
            return  # nothing published yet: a follower waits for the first stage
        self._republished += 1
        self._publish_locked()

    def _publish_locked(self) -> None:
        stage = self._stage
        assert stage is not None
        version = stage.version if not self._republished else f"{stage.version}+m{self._republished}"
        nodes = self._nodes_locked()
        counts = Counter(nodes.values())
        spine_limits = stage.placements is not None and stage.placements.get("ratelimit") == "local"
        spine_share, layered_share = side_shares(stage.spine_weight, spine_limits)
        for node_id, role in sorted(nodes.items()):
            replicas = counts[role]
            assignment = stage_pb2.StageAssignment(
                stage_version=stage.version, side=SIDES[role], spine_weight=stage.spine_weight, replicas=replicas,
                ratelimit_share=replica_share(spine_share if role == ROLE_SPINE else layered_share, replicas))
            if role == ROLE_SPINE and stage.placements:
                assignment.placements.update(stage.placements)
            self._cache.set_snapshot(node_id, Snapshot(version, {STAGE: {RESOURCE_NAME: assignment}}))
            self._assigned[node_id] = assignment
        self._version = version
        if self._republished:
            log.info("xds: followers changed (%s); republished stage %s as %s",
                     ", ".join(f"{counts[r]} {r}" for r in ROLES), stage.version, version)


__all__ = ["RESOURCE_NAME", "ROLES", "FollowerStage", "StageFollowers"]
