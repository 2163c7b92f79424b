"""Resources built from a stage's weights, and the consistency check before publishing."""

from __future__ import annotations

import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import config_source_pb2, health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2
from envoy.type.matcher.v3 import string_pb2

from migration.xds import Endpoint, Snapshot, build_snapshot
from migration.xds.snapshot import CLUSTER, ENDPOINT, LISTENER, ROUTE, build_cluster, build_route
from services.common import ConfigError

ENDPOINTS = {
    "layered": [Endpoint("127.0.0.1", 7001), Endpoint("127.0.0.1", 7003, healthy=False)],
    "spine": [Endpoint("127.0.0.1", 7002)],
}


def snapshot(layered: int = 30, spine: int = 70, version: str = "v1") -> Snapshot:
    return build_snapshot("spine-gateway", {"layered": layered, "spine": spine}, ENDPOINTS, version)


def test_listener_is_an_api_listener_fetching_rds_over_ads_with_the_router_filter() -> None:
    listener = snapshot().of_type(LISTENER)["spine-gateway"]
    assert isinstance(listener, listener_pb2.Listener)
    hcm = http_connection_manager_pb2.HttpConnectionManager()
    assert listener.api_listener.api_listener.Unpack(hcm)
    assert hcm.rds.route_config_name == "spine-gateway-route"
    assert hcm.rds.config_source.HasField("ads")
    assert hcm.rds.config_source.resource_api_version == config_source_pb2.V3
    assert [f.name for f in hcm.http_filters] == ["envoy.filters.http.router"]
    assert hcm.http_filters[-1].typed_config.Is(router_pb2.Router.DESCRIPTOR)


def test_route_splits_by_weight_and_keeps_zero_weight_clusters() -> None:
    route = snapshot(0, 100).of_type(ROUTE)["spine-gateway-route"]
    assert isinstance(route, route_pb2.RouteConfiguration)
    (vhost,) = route.virtual_hosts
    assert list(vhost.domains) == ["*"]
    (r,) = vhost.routes
    assert r.match.HasField("prefix") and r.match.prefix == ""
    weights = {c.name: c.weight.value for c in r.route.weighted_clusters.clusters}
    assert weights == {"layered": 0, "spine": 100}


def test_with_the_route_header_on_an_exact_x_spine_route_match_comes_before_the_weights() -> None:
    snap = build_snapshot("spine-gateway", {"layered": 10_000, "spine": 0}, ENDPOINTS, "v1", route_header=True)
    snap.check()
    route = snap.of_type(ROUTE)["spine-gateway-route"]
    assert isinstance(route, route_pb2.RouteConfiguration)
    (vhost,) = route.virtual_hosts
    *forced, catch_all = vhost.routes
    expected = {side: route_components_pb2.HeaderMatcher(
        name="x-spine-route", string_match=string_pb2.StringMatcher(exact=side)) for side in ("layered", "spine")}
    assert {r.route.cluster: list(r.match.headers) for r in forced} == {
        side: [matcher] for side, matcher in expected.items()}
    assert all(r.match.prefix == "" and not r.route.HasField("weighted_clusters") for r in forced)
    assert not catch_all.match.headers
    assert {c.name: c.weight.value for c in catch_all.route.weighted_clusters.clusters} == {
        "layered": 10_000, "spine": 0}


def test_with_the_route_header_off_only_the_weights_decide() -> None:
    for snap in (snapshot(), build_snapshot("spine-gateway", {"layered": 1, "spine": 1}, ENDPOINTS, "v1",
                                            route_header=False)):
        route = snap.of_type(ROUTE)["spine-gateway-route"]
        assert isinstance(route, route_pb2.RouteConfiguration)
        (vhost,) = route.virtual_hosts
        (only,) = vhost.routes
        assert not only.match.headers and only.route.HasField("weighted_clusters")


def test_clusters_are_eds_over_ads_round_robin() -> None:
    clusters = snapshot().of_type(CLUSTER)
    assert sorted(clusters) == ["layered", "spine"]
    for name, cluster in clusters.items():
        assert isinstance(cluster, cluster_pb2.Cluster)
        assert cluster.type == cluster_pb2.Cluster.EDS
        assert cluster.lb_policy == cluster_pb2.Cluster.ROUND_ROBIN
        assert cluster.eds_cluster_config.service_name == name
        assert cluster.eds_cluster_config.eds_config.HasField("ads")
        assert cluster.eds_cluster_config.eds_config.resource_api_version == config_source_pb2.V3


def test_load_assignment_has_one_weighted_locality_with_endpoint_health() -> None:
    cla = snapshot().of_type(ENDPOINT)["layered"]
    assert isinstance(cla, endpoint_pb2.ClusterLoadAssignment)
    (locality,) = cla.endpoints
    assert locality.HasField("locality") and locality.load_balancing_weight.value == 1
    seen = [
        (e.endpoint.address.socket_address.port_value, e.health_status) for e in locality.lb_endpoints
    ]
    assert seen == [(7001, health_check_pb2.HEALTHY), (7003, health_check_pb2.UNHEALTHY)]


@pytest.mark.parametrize(
    ("weights", "fragment"),
    [
        ({"layered": 0, "spine": 0}, "total must be > 0"),
        ({"layered": -1, "spine": 5}, "weights.layered: expected an integer >= 0, got -1"),
        ({"layered": 1.5, "spine": 5}, "weights.layered"),
        ({"layered": True, "spine": 5}, "weights.layered"),
        ({"layered": 2**32, "spine": 0}, "exceeds the limit"),
        ({}, "at least one cluster"),
    ],
)
def test_weights_a_data_plane_would_reject_are_refused(weights: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.").replace("(", r"\(")):
        build_snapshot("spine-gateway", weights, ENDPOINTS, "v1")


def test_route_naming_a_missing_cluster_fails_the_check_naming_it() -> None:
    with pytest.raises(ConfigError, match="route 'spine-gateway-route' names cluster 'canary'"):
        build_snapshot("spine-gateway", {"layered": 1, "canary": 1}, ENDPOINTS, "v1")


def test_cluster_without_load_assignment_fails_the_check_naming_it() -> None:
    snap = snapshot()
    snap.resources[CLUSTER]["orphan"] = build_cluster("orphan")
    with pytest.raises(ConfigError, match="cluster 'orphan' has no load assignment 'orphan'"):
        snap.check()


def test_listener_naming_a_missing_route_fails_the_check() -> None:
    snap = snapshot()
    snap.resources[ROUTE] = {"other": build_route("other", {"layered": 1})}
    with pytest.raises(ConfigError, match="listener 'spine-gateway' names route 'spine-gateway-route'"):
        snap.check()


def test_empty_version_is_refused() -> None:
    with pytest.raises(ConfigError, match="version"):
        snapshot(version="")


def test_packed_resources_are_serialized_once_per_snapshot() -> None:
    snap = snapshot()
    first = snap.packed(CLUSTER)
    assert snap.packed(CLUSTER) is first
    assert sorted(first) == ["layered", "spine"]
    assert first["spine"].type_url == CLUSTER


def test_the_sides_http_apis_get_a_route_of_their_own_with_the_same_weights() -> None:
    """`<side>-http` endpoints: `<service>-http-route` splits between them as the gRPC route
    does, and `x-spine-route: <side>` forces the side's HTTP cluster."""
    snapshot = build_snapshot("spine-gateway", {"layered": 7500, "spine": 2500}, {
        "layered": [Endpoint("127.0.0.1", 1)], "spine": [Endpoint("127.0.0.1", 2)],
        "layered-http": [Endpoint("127.0.0.1", 3)], "spine-http": [Endpoint("127.0.0.1", 4)]}, "v1",
        route_header=True)
    route = snapshot.of_type(ROUTE)["spine-gateway-http-route"]
    assert isinstance(route, route_pb2.RouteConfiguration)
    weighted = route.virtual_hosts[0].routes[-1].route.weighted_clusters.clusters
    assert {c.name: c.weight.value for c in weighted} == {"layered-http": 7500, "spine-http": 2500}
    forced = {r.match.headers[0].string_match.exact: r.route.cluster for r in route.virtual_hosts[0].routes[:-1]}
    assert forced == {"layered": "layered-http", "spine": "spine-http"}
    assignment = snapshot.of_type(ENDPOINT)["spine-http"]
    assert isinstance(assignment, endpoint_pb2.ClusterLoadAssignment)
    assert assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address.port_value == 4
    without = build_snapshot("spine-gateway", {"layered": 1, "spine": 1}, {
        "layered": [Endpoint("127.0.0.1", 1)], "spine": [Endpoint("127.0.0.1", 2)]}, "v1")
    assert list(without.of_type(ROUTE)) == ["spine-gateway-route"]  # no HTTP endpoints, no HTTP route
