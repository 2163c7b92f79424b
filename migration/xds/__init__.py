"""An xDS control plane (ADS, state of the world, v3) for Envoy and proxyless gRPC clients.

snapshot.py builds resources from a stage's weights, cache.py keeps them per node, server.py
speaks the protocol, control_plane.py is the facade the migration controller calls.
"""

from migration.xds.cache import ANY_NODE, SnapshotCache
from migration.xds.control_plane import XdsControlPlane
from migration.xds.server import AdsServer
from migration.xds.snapshot import LAYERED, SPINE, Endpoint, Snapshot, build_snapshot

__all__ = [
    "ANY_NODE",
    "LAYERED",
    "SPINE",
    "AdsServer",
    "Endpoint",
    "Snapshot",
    "SnapshotCache",
    "XdsControlPlane",
    "build_snapshot",
]
