"""The ADS server speaking to hand-driven data planes: ACK/NACK, pushes, bad input, many nodes."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator

import grpc
import pytest
from envoy.config.route.v3 import route_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.rpc import status_pb2

from migration.xds import Endpoint, XdsControlPlane
from migration.xds.snapshot import CLUSTER, ENDPOINT, LISTENER, ROUTE, STAGE
from services.common import ConfigError
from wire.v1 import stage_pb2

ENDPOINTS = {"layered": [Endpoint("127.0.0.1", 7001)], "spine": [Endpoint("127.0.0.1", 7002)]}
_END = object()


class FakeDataPlane:
    """A data plane driven by the test: sends DiscoveryRequests, receives responses."""

    def __init__(self, address: str, node_id: str, role: str = "") -> None:
        self.node_id = node_id
        self.role = role
        self.channel = grpc.insecure_channel(address)
        self._requests: queue.Queue[object] = queue.Queue()
        self._responses: queue.Queue[object] = queue.Queue()
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(self.channel)
        self.call = stub.StreamAggregatedResources(self._iter_requests())
        threading.Thread(target=self._read, daemon=True).start()
        self._first = True

    def _iter_requests(self) -> Iterator[discovery_pb2.DiscoveryRequest]:
        while True:
            item = self._requests.get()
            if item is _END:
                return
            assert isinstance(item, discovery_pb2.DiscoveryRequest)
            yield item

    def _read(self) -> None:
        try:
            for response in self.call:
                self._responses.put(response)
        except grpc.RpcError as err:
            self._responses.put(err)

    def send(
        self, type_url: str, names: list[str] | None = None, version: str = "", nonce: str = "",
        error: str | None = None,
    ) -> None:
        request = discovery_pb2.DiscoveryRequest(
            type_url=type_url, resource_names=names or [], version_info=version, response_nonce=nonce
        )
        if self._first:
            request.node.id = self.node_id
            if self.role:
                request.node.metadata.update({"role": self.role})
            self._first = False
        if error is not None:
            request.error_detail.CopyFrom(status_pb2.Status(code=3, message=error))
        self._requests.put(request)

    def recv(self, timeout: float = 5.0) -> discovery_pb2.DiscoveryResponse:
        item = self._responses.get(timeout=timeout)
        assert isinstance(item, discovery_pb2.DiscoveryResponse), item
        return item

    def nothing_within(self, timeout: float) -> bool:
        try:
            self._responses.get(timeout=timeout)
        except queue.Empty:
            return True
        return False

    def ack(self, response: discovery_pb2.DiscoveryResponse, names: list[str] | None = None) -> None:
        self.send(response.type_url, names, version=response.version_info, nonce=response.nonce)

    def subscribe_all(self, version: str) -> None:
        """Subscribe to the four types the way gRPC does and ACK each answer."""
        for type_url, names in (
            (LISTENER, ["spine-gateway"]), (ROUTE, ["spine-gateway-route"]),
            (CLUSTER, ["layered", "spine"]), (ENDPOINT, ["layered", "spine"]),
        ):
            self.send(type_url, names)
            response = self.recv()
            assert response.version_info == version
            self.ack(response, names)

    def close(self) -> None:
        self._requests.put(_END)
        self.call.cancel()
        self.channel.close()


@pytest.fixture
def plane() -> Iterator[XdsControlPlane]:
    cp = XdsControlPlane(endpoints=ENDPOINTS, max_streams=32)
    cp.start()
    yield cp
    cp.stop(grace=0)


def connect(plane: XdsControlPlane, node_id: str) -> FakeDataPlane:
    assert plane.address is not None
    return FakeDataPlane(plane.address, node_id)


def test_wildcard_cds_request_gets_every_cluster(plane: XdsControlPlane) -> None:
    plane.set_weights(100, 0, "v1")
    dp = connect(plane, "envoy-1")
    dp.send(CLUSTER)
    response = dp.recv()
    assert (response.type_url, response.version_info) == (CLUSTER, "v1")
    assert sorted(r.type_url for r in response.resources) == [CLUSTER, CLUSTER]
    dp.close()


def test_named_rds_request_gets_only_that_route(plane: XdsControlPlane) -> None:
    plane.set_weights(30, 70, "v1")
    dp = connect(plane, "grpc-1")
    dp.send(ROUTE, ["spine-gateway-route"])
    response = dp.recv()
    route = route_pb2.RouteConfiguration()
    assert len(response.resources) == 1 and response.resources[0].Unpack(route)
    weights = {c.name: c.weight.value for c in route.virtual_hosts[0].routes[0].route.weighted_clusters.clusters}
    assert weights == {"layered": 30, "spine": 70}
    dp.close()


def test_acked_once_every_subscribed_type_acks_the_version(plane: XdsControlPlane) -> None:
    plane.set_weights(100, 0, "v1")
    dp = connect(plane, "grpc-1")
    dp.send(LISTENER, ["spine-gateway"])
    first = dp.recv()
    assert not plane.acked("v1")  # sent, not yet acknowledged
    dp.ack(first, ["spine-gateway"])
    assert plane.wait_acked("v1", timeout=5)
    rows = plane.status()
    assert [(r["node_id"], r["type"], r["acked_version"], r["nack_error"]) for r in rows] == [
        ("grpc-1", "LDS", "v1", None)
    ]
    assert rows[0]["last_seen"] > 0
    dp.close()


def test_snapshot_change_is_pushed_to_every_subscribed_type(plane: XdsControlPlane) -> None:
    plane.set_weights(100, 0, "v1")
    dp = connect(plane, "envoy-1")
    dp.subscribe_all("v1")
    assert plane.wait_acked("v1", timeout=5)
    plane.set_weights(50, 50, "v2")
    pushed = [dp.recv() for _ in range(4)]
    # Clusters and endpoints first, so a route never names a cluster the data plane lacks.
    assert [r.type_url for r in pushed] == [CLUSTER, ENDPOINT, LISTENER, ROUTE]
    assert {r.version_info for r in pushed} == {"v2"}
    assert not plane.acked("v2")
    for response in pushed:
        dp.ack(response, list(_names(response)))
    assert plane.wait_acked("v2", timeout=5)
    dp.close()


def test_nack_keeps_last_good_version_and_records_the_error(
    plane: XdsControlPlane, caplog: pytest.LogCaptureFixture
) -> None:
    plane.set_weights(100, 0, "v1")
    dp = connect(plane, "envoy-1")
    dp.send(ROUTE, ["spine-gateway-route"])
    dp.ack(dp.recv(), ["spine-gateway-route"])
    assert plane.wait_acked("v1", timeout=5)
    plane.set_weights(90, 10, "v2")
    bad = dp.recv()
    with caplog.at_level(logging.WARNING, logger="spine.xds"):
        dp.send(ROUTE, ["spine-gateway-route"], version="v1", nonce=bad.nonce, error="weights rejected")
        assert plane.ads.wait_for(lambda: bool(plane.status()[0]["nack_error"]), timeout=5)
    row = plane.status()[0]
    assert (row["acked_version"], row["nack_error"], row["nacked_version"]) == ("v1", "weights rejected", "v2")
    assert not plane.acked("v2") and plane.acked("v1")
    assert "rejected RDS version v2 (keeps v1): weights rejected" in caplog.text
    assert dp.nothing_within(0.3)  # the refused version is not sent again
    plane.set_weights(80, 20, "v3")  # the next good version clears the error once ACKed
    dp.ack(dp.recv(), ["spine-gateway-route"])
    assert plane.wait_acked("v3", timeout=5)
    assert plane.status()[0]["nack_error"] is None
    dp.close()


def test_request_with_stale_nonce_is_ignored(plane: XdsControlPlane) -> None:
    plane.set_weights(100, 0, "v1")
    dp = connect(plane, "envoy-1")
    dp.send(CLUSTER)
    old = dp.recv()
    plane.set_weights(50, 50, "v2")
    new = dp.recv()
    dp.send(CLUSTER, version="v1", nonce=old.nonce)  # answers a replaced response: not an ACK
    assert dp.nothing_within(0.3)
    assert plane.status()[0]["acked_version"] is None
    dp.ack(new)
    assert plane.wait_acked("v2", timeout=5)
    dp.close()


def test_unknown_resource_names_get_an_empty_answer_and_a_log_line(
    plane: XdsControlPlane, caplog: pytest.LogCaptureFixture
) -> None:
    plane.set_weights(100, 0, "v1")
    dp = connect(plane, "grpc-1")
    with caplog.at_level(logging.WARNING, logger="spine.xds"):
        dp.send(ROUTE, ["no-such-route"])
        response = dp.recv()
    assert response.version_info == "v1" and list(response.resources) == []
    assert "['no-such-route']" in caplog.text and "lacks" in caplog.text
    dp.send(ENDPOINT, ["spine", "ghost"])
    assert [r.type_url for r in dp.recv().resources] == [ENDPOINT]  # known names still served
    dp.close()


def test_unknown_type_url_gets_an_empty_answer(plane: XdsControlPlane, caplog: pytest.LogCaptureFixture) -> None:
    plane.set_weights(100, 0, "v1")
    dp = connect(plane, "odd-1")
    with caplog.at_level(logging.WARNING, logger="spine.xds"):
        dp.send("type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret")
        response = dp.recv()
    assert list(response.resources) == [] and "unknown type" in caplog.text
    dp.send(CLUSTER)  # the stream still works
    assert len(dp.recv().resources) == 2
    dp.close()


def test_node_connected_before_first_snapshot_gets_it_when_published(plane: XdsControlPlane) -> None:
    dp = connect(plane, "early")
    dp.send(LISTENER, ["spine-gateway"])
    assert dp.nothing_within(0.2)
    plane.set_weights(100, 0, "v1")
    assert dp.recv().version_info == "v1"
    dp.close()


def test_dropped_stream_is_removed_from_connected_nodes(plane: XdsControlPlane) -> None:
    plane.set_weights(100, 0, "v1")
    dp = connect(plane, "leaving")
    dp.send(CLUSTER)
    dp.recv()
    assert plane.ads.wait_for(lambda: plane.ads.connected() == ["leaving"], timeout=5)
    assert not plane.acked("v1")
    dp.close()
    assert plane.ads.wait_for(lambda: plane.ads.connected() == [], timeout=5)
    assert plane.status() == [] and plane.acked("v1")


def test_acked_needs_min_nodes_connected(plane: XdsControlPlane) -> None:
    plane.set_weights(100, 0, "v1")
    assert plane.acked("v1") and not plane.acked("v1", min_nodes=1)


def test_per_node_snapshot_overrides_default(plane: XdsControlPlane) -> None:
    from migration.xds import build_snapshot

    plane.set_weights(100, 0, "v1")
    plane.cache.set_snapshot("canary", build_snapshot("spine-gateway", {"layered": 0, "spine": 1}, ENDPOINTS, "c1"))
    canary, other = connect(plane, "canary"), connect(plane, "other")
    canary.send(CLUSTER)
    other.send(CLUSTER)
    assert canary.recv().version_info == "c1" and other.recv().version_info == "v1"
    canary.close()
    other.close()


def test_twenty_nodes_served_from_one_cache(plane: XdsControlPlane) -> None:
    plane.set_weights(100, 0, "v1")
    planes = [connect(plane, f"node-{i}") for i in range(20)]
    for dp in planes:
        dp.subscribe_all("v1")
    assert plane.wait_acked("v1", timeout=10, min_nodes=20)
    plane.set_weights(0, 100, "v2")
    for dp in planes:
        for _ in range(4):
            response = dp.recv()
            dp.ack(response, list(_names(response)))
    assert plane.wait_acked("v2", timeout=10, min_nodes=20)
    assert len({r["node_id"] for r in plane.status()}) == 20
    for dp in planes:
        dp.close()
    assert plane.ads.wait_for(lambda: plane.ads.connected() == [], timeout=10)


def test_stop_ends_open_streams(plane: XdsControlPlane) -> None:
    plane.set_weights(100, 0, "v1")
    dp = connect(plane, "envoy-1")
    dp.send(CLUSTER)
    dp.recv()
    plane.stop(grace=0)
    assert plane.ads.wait_for(lambda: plane.ads.connected() == [], timeout=5)
    dp.close()


def _names(response: discovery_pb2.DiscoveryResponse) -> list[str]:
    """The resource names in a response, as a gRPC client would re-request them."""
    by_type = {
        LISTENER: ["spine-gateway"], ROUTE: ["spine-gateway-route"],
        CLUSTER: ["layered", "spine"], ENDPOINT: ["layered", "spine"],
    }
    return by_type[response.type_url]


def test_spine_percent_becomes_weights_in_hundredths(plane: XdsControlPlane) -> None:
    from migration.xds.snapshot import ROUTE as ROUTE_TYPE

    snap = plane.set_spine_percent(0.5, "canary-0.5")
    route = snap.of_type(ROUTE_TYPE)["spine-gateway-route"]
    assert isinstance(route, route_pb2.RouteConfiguration)
    clusters = route.virtual_hosts[0].routes[0].route.weighted_clusters.clusters
    assert {c.name: c.weight.value for c in clusters} == {"layered": 9950, "spine": 50}
    with pytest.raises(ConfigError, match="spine_weight: expected a percentage between 0 and 100, got 150"):
        plane.set_spine_percent(150, "bad")
    assert plane.version == "canary-0.5"


def test_set_endpoints_republishes_under_a_derived_version(plane: XdsControlPlane) -> None:
    assert plane.set_endpoints({"spine": [Endpoint("127.0.0.1", 7010)]}) is None  # no weights yet
    plane.set_weights(100, 0, "v1")
    snap = plane.set_endpoints({"spine": [Endpoint("127.0.0.1", 7011, healthy=False)]})
    assert snap is not None and snap.version == "v1+e1" and plane.version == "v1+e1"
    dp = connect(plane, "envoy-1")
    dp.send(ENDPOINT, ["spine"])
    response = dp.recv()
    assert response.version_info == "v1+e1"
    dp.close()


def test_stopped_control_plane_cannot_be_restarted(plane: XdsControlPlane) -> None:
    plane.stop(grace=0)
    with pytest.raises(RuntimeError, match="make a new XdsControlPlane"):
        plane.start()


def test_a_follower_is_served_only_its_own_assignment_never_the_data_planes_default(plane: XdsControlPlane) -> None:
    """A node with a role gets nothing from the default snapshot: an empty answer under a
    stage's version is one it could ACK without having applied anything."""
    assert plane.address is not None
    plane.set_weights(100, 0, "v1")  # weights alone: no stage for followers
    follower = FakeDataPlane(plane.address, "spine-1", role="spine")
    follower.send(STAGE)
    assert follower.nothing_within(0.3)
    plane.set_stage(25, {"ratelimit": "local"}, "v2")
    response = follower.recv()
    assignment = stage_pb2.StageAssignment()
    assert response.version_info == "v2" and response.resources[0].Unpack(assignment)
    assert (assignment.side, assignment.ratelimit_share, assignment.placements["ratelimit"]) == ("spine", 0.25, "local")
    follower.ack(response)
    assert plane.ads.wait_for(lambda: plane.followers_applied("v2", 1), timeout=5)
    assert plane.acked("v2")  # the data planes' side: none connected, the follower not counted there
    assert [row["node_id"] for row in plane.followers_status()] == ["spine-1"] and plane.status() == []
    follower.close()


def test_a_node_naming_an_unknown_role_gets_no_assignment_and_holds_nothing(plane: XdsControlPlane) -> None:
    assert plane.address is not None
    plane.set_stage(50, {"ratelimit": "local"}, "v1")
    odd = FakeDataPlane(plane.address, "odd-1", role="sidecar")
    odd.send(STAGE)
    assert odd.nothing_within(0.3)
    assert plane.followers_applied("v1", 0)  # it is no follower of a role the stage waits for
    odd.close()
