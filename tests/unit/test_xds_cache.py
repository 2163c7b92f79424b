"""SnapshotCache: a default for every node, per-node overrides, watchers, checked publishing."""

from __future__ import annotations

import pytest

from migration.xds import ANY_NODE, Endpoint, SnapshotCache, build_snapshot
from migration.xds.snapshot import CLUSTER, Snapshot, build_cluster
from services.common import ConfigError

ENDPOINTS = {"layered": [Endpoint("127.0.0.1", 7001)], "spine": [Endpoint("127.0.0.1", 7002)]}


def snap(version: str, spine: int = 0) -> Snapshot:
    return build_snapshot("spine-gateway", {"layered": 100 - spine, "spine": spine}, ENDPOINTS, version)


def test_default_snapshot_serves_every_node() -> None:
    cache = SnapshotCache()
    assert cache.get("envoy-1") is None
    cache.set_snapshot(ANY_NODE, snap("v1"))
    assert cache.get("envoy-1").version == cache.get("grpc-7").version == "v1"  # type: ignore[union-attr]


def test_node_snapshot_overrides_default_until_cleared() -> None:
    cache = SnapshotCache()
    cache.set_snapshot(ANY_NODE, snap("v1"))
    cache.set_snapshot("canary", snap("c1", spine=100))
    assert cache.get("canary").version == "c1"  # type: ignore[union-attr]
    assert cache.get("other").version == "v1"  # type: ignore[union-attr]
    cache.clear("canary")
    assert cache.get("canary").version == "v1"  # type: ignore[union-attr]
    assert cache.nodes() == [ANY_NODE]


def test_watchers_hear_which_node_changed_until_cancelled() -> None:
    cache = SnapshotCache()
    heard: list[str] = []
    cancel = cache.watch(heard.append)
    cache.set_snapshot(ANY_NODE, snap("v1"))
    cache.set_snapshot("canary", snap("c1"))
    cache.clear("canary")
    cache.clear("never-set")  # nothing changed: nobody is told
    cancel()
    cache.set_snapshot(ANY_NODE, snap("v2"))
    assert heard == [ANY_NODE, "canary", "canary"]


def test_inconsistent_snapshot_is_refused_and_the_previous_one_stays() -> None:
    cache = SnapshotCache()
    heard: list[str] = []
    cache.watch(heard.append)
    cache.set_snapshot(ANY_NODE, snap("v1"))
    broken = snap("v2")
    broken.resources[CLUSTER]["ghost"] = build_cluster("ghost")
    with pytest.raises(ConfigError, match="cluster 'ghost' has no load assignment"):
        cache.set_snapshot(ANY_NODE, broken)
    assert cache.get("any").version == "v1"  # type: ignore[union-attr]
    assert heard == [ANY_NODE]
