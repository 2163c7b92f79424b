"""What the migration controller drives: weights, placements and endpoints in, ACK state out.

`XdsControlPlane` owns a SnapshotCache, the ADS servicer and a gRPC server on loopback (by
default). Each `set_stage` publishes one versioned snapshot for every data plane (the weights)
and one for every follower of the controller (`StageFollowers`: a spine replica's placements,
each rate limiter's share of the limits); the controller's gate then waits until the data
planes (`stage_acked`) and the followers (`followers_applied`) have ACKed it before it counts
a stage as reached. `set_spine_percent` publishes weights alone (the built-in front moves
placements itself).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from typing import Any

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc

from migration.xds.cache import ANY_NODE, SnapshotCache
from migration.xds.followers import StageFollowers
from migration.xds.server import AdsServer
from migration.xds.snapshot import LAYERED, SPINE, Endpoint, Snapshot, build_snapshot
from runtime.config.sections import TlsConfig
from runtime.stage_follower import ROLE_LAYERED_RATELIMIT, ROLE_SPINE
from runtime.tls import add_port
from services.common import ConfigError


class XdsControlPlane:
    """An ADS server whose snapshot follows the migration stage's weights.

    Nothing is served until the first `set_weights`: a data plane that connects earlier waits
    for it rather than getting a guessed split.
    """

    def __init__(
        self,
        service: str = "spine-gateway",
        endpoints: Mapping[str, Sequence[Endpoint]] | None = None,
        *,
        node_id: str = ANY_NODE,
        max_streams: int = 256,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if max_streams < 1:
            raise ConfigError(f"xds.max_streams: expected >= 1, got {max_streams}")
        self.service = service
        self.node_id = node_id
        self.max_streams = max_streams
        self.cache = SnapshotCache()
        self.followers = StageFollowers(self.cache)
        self.ads = AdsServer(self.cache, wall_clock=wall_clock, callbacks=self.followers)
        self._lock = threading.Lock()
        self._endpoints: dict[str, list[Endpoint]] = {LAYERED: [], SPINE: []}
        self._endpoints.update({name: list(eps) for name, eps in (endpoints or {}).items()})
        self._weights: dict[str, int] | None = None
        self._route_header = False  # what the last stage said about `x-spine-route`
        self._version: str | None = None
        self._endpoint_updates = 0
        self._server: grpc.Server | None = None
        self._stopped = False
        self.address: str | None = None

    @property
    def version(self) -> str | None:
        """The version last published (None before the first `set_weights`)."""
        return self._version

    def start(self, listen: str = "127.0.0.1:0", tls: TlsConfig | None = None) -> str:
        """Serve ADS on `listen` (host:port, port 0 = any free one); returns host:port. With
        `tls`, over TLS (mTLS with `tls.client_ca_file`: every data plane and follower then
        presents a certificate from that CA)."""
        if self._server is not None:
            raise RuntimeError(f"xds control plane already listening on {self.address}")
        if self._stopped:
            raise RuntimeError("xds control plane was stopped; make a new XdsControlPlane")
        # Two threads per stream (a worker here plus a reader); RPCs past the limit get
        # RESOURCE_EXHAUSTED instead of queueing silently.
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=self.max_streams + 4, thread_name_prefix="ads"),
            maximum_concurrent_rpcs=self.max_streams,
        )
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(self.ads, server)
        port = add_port(server, listen, tls, "--tls")
        if port == 0:
            raise ConfigError(f"xds.listen: cannot bind {listen!r}")
        server.start()
        self._server = server
        self.address = f"{listen.rsplit(':', 1)[0]}:{port}"
        return self.address

    def set_weights(self, layered: int, spine: int, version: str, *, route_header: bool = False) -> Snapshot:
        """Publish the split `layered`:`spine` as `version` (ConfigError if it cannot be served).

        `route_header`: whether `x-spine-route: layered|spine` forces a side (header-matched
        routes before the weighted one); off unless a plan turns it on."""
        with self._lock:
            snapshot = build_snapshot(
                self.service, {LAYERED: layered, SPINE: spine}, self._endpoints, version,
                route_header=route_header,
            )
            self.cache.set_snapshot(self.node_id, snapshot)
            self._weights = {LAYERED: layered, SPINE: spine}
            self._route_header = route_header
            self._version = version
        return snapshot

    def set_spine_percent(self, spine_weight: float, version: str, *, route_header: bool = False) -> Snapshot:
        """Publish weights given as the spine's share in percent (0-100, fractions allowed).

        Weights are sent in hundredths of a percent so a 0.5 % canary is exact.
        """
        return self.set_weights(*_weights(spine_weight), version, route_header=route_header)

    def set_stage(self, spine_weight: float, placements: Mapping[str, str] | None, version: str, *,
                  route_header: bool = False) -> Snapshot:
        """Publish a whole stage as `version`: its weights to every data plane, its placements
        and rate-limit shares to every follower (`placements` None: the stable state, in which a
        spine keeps its own). The call behind the controller's `TrafficTarget.apply`;
        `route_header` is the running plan's (whether `x-spine-route` routes are published).

        Checked before anything is published (a stage that cannot be served changes nothing);
        followers get theirs first, so a spine has its placements by the time data planes that
        ACK quickly send it the new weight.
        """
        layered, spine = _weights(spine_weight)
        with self._lock:
            snapshot = build_snapshot(self.service, {LAYERED: layered, SPINE: spine}, self._endpoints, version,
                                      route_header=route_header)
            self.followers.set_stage(spine_weight, placements, version)
            self.cache.set_snapshot(self.node_id, snapshot)
            self._weights = {LAYERED: layered, SPINE: spine}
            self._route_header = route_header
            self._version = version
        return snapshot

    def set_endpoints(
        self, endpoints: Mapping[str, Sequence[Endpoint]], version: str | None = None
    ) -> Snapshot | None:
        """Replace the endpoints of the named clusters (others keep theirs) and republish.

        Without `version` the new one is derived from the current weights' version, e.g.
        "stage-2+e1", so `acked()` can tell the endpoint change apart. Before any weights are
        set the endpoints are only stored.
        """
        with self._lock:
            self._endpoints.update({name: list(eps) for name, eps in endpoints.items()})
            if self._weights is None:
                return None
            self._endpoint_updates += 1
            version = version or f"{self._version}+e{self._endpoint_updates}"
            snapshot = build_snapshot(self.service, self._weights, self._endpoints, version,
                                      route_header=self._route_header)
            self.cache.set_snapshot(self.node_id, snapshot)
            self._version = version
            return snapshot

    def publish(self, snapshot: Snapshot) -> None:
        """Serve a hand-built snapshot (checked for consistency first)."""
        with self._lock:
            self.cache.set_snapshot(self.node_id, snapshot)
            self._version = snapshot.version

    def acked(self, version: str, min_nodes: int = 0) -> bool:
        """Every connected data plane has ACKed `version` for every type it subscribes to."""
        return self.ads.acked(version, min_nodes)

    def stage_acked(self, version: str, min_nodes: int = 0) -> bool:
        """`version`'s weights are in force everywhere: it, or an endpoint update made on top of
        it ("<version>+e<n>", e.g. an endpoint turning unhealthy), is ACKed by every data plane."""
        current = self._version
        if current is not None and current.startswith(f"{version}+e"):
            return self.ads.acked(current, min_nodes)
        return self.ads.acked(version, min_nodes)

    def wait_acked(self, version: str, timeout: float, min_nodes: int = 0) -> bool:
        return self.ads.wait_acked(version, timeout, min_nodes)

    def followers_applied(self, version: str, min_spine: int = 0) -> bool:
        """Stage `version` is in force on every follower: at least `min_spine` spine replicas
        are connected, and every connected follower (spine replicas, layered rate limiters)
        has applied and ACKed its current assignment for that stage."""
        current = self.followers.current_version(version)
        if current is None:
            return False
        return (self.ads.acked(current, min_spine, role=ROLE_SPINE)
                and self.ads.acked(current, 0, role=ROLE_LAYERED_RATELIMIT))

    def status(self) -> list[dict[str, Any]]:
        """Per data plane and type: acked_version, nack_error, last_seen (for `spine migrate status`)."""
        return [row for row in self.ads.status() if not row["role"]]

    def followers_status(self) -> list[dict[str, Any]]:
        """Per follower: its role, what it was assigned (share, placements), what it ACKed or
        NACKed and when it was last heard from."""
        assigned = self.followers.assigned()
        rows = []
        for row in self.ads.status():
            if not row["role"]:
                continue
            assignment = assigned.get(row["node_id"])
            rows.append({**row, "ratelimit_share": assignment.ratelimit_share if assignment else None,
                         "replicas": assignment.replicas if assignment else 0,
                         "placements": dict(assignment.placements) if assignment else {}})
        return rows

    def stand_by(self, reason: str) -> None:
        """Serve no one for now: open streams end and new ones are refused (UNAVAILABLE,
        `reason`); `serve` takes them again. A controller replica that does not lead."""
        self.ads.stand_by(reason)

    def serve(self) -> None:
        self.ads.serve()

    def stop(self, grace: float = 1.0) -> None:
        """End every stream and stop listening; data planes keep their last config. Final."""
        self._stopped = True
        self.ads.close()
        if self._server is not None:
            self._server.stop(grace).wait()
            self._server = None


def _weights(spine_weight: float) -> tuple[int, int]:
    """(layered, spine) in hundredths of a percent, so a 0.5 % canary is exact."""
    if isinstance(spine_weight, bool) or not 0 <= spine_weight <= 100:
        raise ConfigError(f"spine_weight: expected a percentage between 0 and 100, got {spine_weight!r}")
    spine = round(spine_weight * 100)
    return 10_000 - spine, spine
