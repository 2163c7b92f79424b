"""Turn a migration stage (weights + endpoints) into a consistent set of xDS resources.

One place decides what a data plane sees: a Listener whose HttpConnectionManager fetches its
route over ADS, a RouteConfiguration that splits traffic between the `layered` and `spine`
clusters, EDS Clusters, and their ClusterLoadAssignments. Proxyless gRPC clients and Envoy read
the same resources, so a stage reaches both kinds of data plane at once.

A snapshot is checked before it is published (as go-control-plane does): a route naming a
cluster that is not served, or a cluster without a load assignment, would make a data plane
drop traffic; the error names the missing resource so the operator can fix the stage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import address_pb2, base_pb2, config_source_pb2, health_check_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2
from envoy.type.matcher.v3 import string_pb2
from google.protobuf import any_pb2, wrappers_pb2
from google.protobuf import message as pb_message

from runtime.stage_follower import STAGE_ASSIGNMENT
from services.common import ConfigError
from wire.v1 import stage_pb2

LISTENER = "type.googleapis.com/envoy.config.listener.v3.Listener"
ROUTE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
CLUSTER = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINT = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
# Our own type: what a stage assigns a follower (a spine replica, a layered rate limiter).
STAGE = STAGE_ASSIGNMENT
# The order a data plane needs them in; also the order responses are pushed in, so a client
# never sees a route before the clusters it names. Followers read only STAGE.
TYPE_URLS: tuple[str, ...] = (CLUSTER, ENDPOINT, LISTENER, ROUTE, STAGE)
TYPE_NAMES = {LISTENER: "LDS", ROUTE: "RDS", CLUSTER: "CDS", ENDPOINT: "EDS", STAGE: "STAGE"}

LAYERED = "layered"
SPINE = "spine"
# The header that forces a side (`layered` or `spine`) where the plan lets it (`route_header`).
ROUTE_HEADER = "x-spine-route"
# Each side's HTTP API (`runtime.http`) is a cluster of its own, `<side>-http`, and the
# HTTP listener's route (`<service>-http-route`) splits between them by the same weights.
HTTP_SUFFIX = "-http"
# gRPC refuses a weighted_clusters total above uint32; Envoy the same.
MAX_TOTAL_WEIGHT = 2**32 - 1


@dataclass(frozen=True)
class Endpoint:
    """One upstream address; `healthy` comes from whoever probes it (the controller)."""

    host: str
    port: int
    healthy: bool = True

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass
class Snapshot:
    """A versioned, self-consistent set of resources: type URL -> resource name -> message."""

    version: str
    resources: dict[str, dict[str, pb_message.Message]] = field(default_factory=dict)
    _packed: dict[str, dict[str, any_pb2.Any]] = field(default_factory=dict, repr=False, compare=False)

    def of_type(self, type_url: str) -> dict[str, pb_message.Message]:
        return self.resources.get(type_url, {})

    def packed(self, type_url: str) -> dict[str, any_pb2.Any]:
        """Resources of one type as Any, serialized once however many streams are served."""
        cached = self._packed.get(type_url)
        if cached is None:
            cached = {}
            for name, resource in self.of_type(type_url).items():
                packed = any_pb2.Any()
                packed.Pack(resource)
                cached[name] = packed
            self._packed[type_url] = cached
        return cached

    def check(self) -> None:
        """Raise ConfigError naming the first missing resource a data plane would need."""
        if not self.version:
            raise ConfigError("snapshot.version: must be a non-empty string")
        clusters = self.of_type(CLUSTER)
        assignments = self.of_type(ENDPOINT)
        routes = self.of_type(ROUTE)
        for name, listener in self.of_type(LISTENER).items():
            assert isinstance(listener, listener_pb2.Listener)
            route_name = _listener_route_name(listener)
            if route_name is not None and route_name not in routes:
                raise ConfigError(
                    f"snapshot {self.version}: listener {name!r} names route {route_name!r}, "
                    f"which is not in the snapshot (routes: {sorted(routes)})"
                )
        for name, route in routes.items():
            assert isinstance(route, route_pb2.RouteConfiguration)
            for cluster in sorted(route_clusters(route)):
                if cluster not in clusters:
                    raise ConfigError(
                        f"snapshot {self.version}: route {name!r} names cluster {cluster!r}, "
                        f"which is not in the snapshot (clusters: {sorted(clusters)})"
                    )
        for name, cluster_msg in clusters.items():
            assert isinstance(cluster_msg, cluster_pb2.Cluster)
            if cluster_msg.type != cluster_pb2.Cluster.EDS:
                continue
            service = cluster_msg.eds_cluster_config.service_name or name
            if service not in assignments:
                raise ConfigError(
                    f"snapshot {self.version}: cluster {name!r} has no load assignment "
                    f"{service!r} (load assignments: {sorted(assignments)})"
                )
        for name, stage in self.of_type(STAGE).items():
            assert isinstance(stage, stage_pb2.StageAssignment)
            bad = {k: v for k, v in stage.placements.items() if v not in ("local", "remote")}
            if bad or not 0.0 <= stage.ratelimit_share <= 1.0:
                raise ConfigError(
                    f"snapshot {self.version}: stage assignment {name!r} needs placements local|remote "
                    f"and a ratelimit_share in [0, 1], got placements {bad or 'ok'}, "
                    f"share {stage.ratelimit_share:g}"
                )


def route_clusters(route: route_pb2.RouteConfiguration) -> set[str]:
    """Every cluster a route configuration can send traffic to."""
    names: set[str] = set()
    for vhost in route.virtual_hosts:
        for r in vhost.routes:
            if not r.HasField("route"):
                continue
            if r.route.HasField("weighted_clusters"):
                names.update(c.name for c in r.route.weighted_clusters.clusters)
            elif r.route.cluster:
                names.add(r.route.cluster)
    return names


def _listener_route_name(listener: listener_pb2.Listener) -> str | None:
    if not listener.HasField("api_listener"):
        return None
    hcm = http_connection_manager_pb2.HttpConnectionManager()
    if not listener.api_listener.api_listener.Unpack(hcm):
        return None
    return hcm.rds.route_config_name if hcm.HasField("rds") else None


def _ads_source() -> config_source_pb2.ConfigSource:
    # Both fields matter: without resource_api_version V3 gRPC rejects the source, without
    # `ads` it would look for a separate server.
    return config_source_pb2.ConfigSource(
        ads=config_source_pb2.AggregatedConfigSource(),
        resource_api_version=config_source_pb2.V3,
    )


def build_listener(service: str, route_name: str) -> listener_pb2.Listener:
    """An api_listener (what proxyless gRPC reads for `xds:///<service>`) fetching RDS over ADS."""
    hcm = http_connection_manager_pb2.HttpConnectionManager(
        stat_prefix=service,
        rds=http_connection_manager_pb2.Rds(config_source=_ads_source(), route_config_name=route_name),
    )
    # The router filter must be last and present: without it gRPC fails every RPC.
    router = hcm.http_filters.add(name="envoy.filters.http.router")
    router.typed_config.Pack(router_pb2.Router())
    listener = listener_pb2.Listener(name=service)
    listener.api_listener.api_listener.Pack(hcm)
    return listener


def build_route(route_name: str, weights: Mapping[str, int], *, route_header: bool = False,
                sides: Mapping[str, str] | None = None) -> route_pb2.RouteConfiguration:
    """One catch-all route splitting by weight. Weight-0 clusters stay in the list so that
    shifting back to them is a weight change, not a new cluster (no reconnect).

    With `route_header`, one route per cluster comes first, matching `x-spine-route: <side>`
    exactly and sending the request there whatever the weights (the operator's tool for forcing
    a side); without it a client's `x-spine-route` matches nothing and the weights decide.
    `sides`: the side each cluster serves, where the two differ (the HTTP route's
    `layered-http` serves `layered`); a cluster is its own side otherwise."""
    action = route_components_pb2.RouteAction()
    for name, weight in weights.items():
        action.weighted_clusters.clusters.add(name=name, weight=wrappers_pb2.UInt32Value(value=weight))
    sides = sides or {}
    forced = [_forced_route(name, sides.get(name, name)) for name in sorted(weights)] if route_header else []
    return route_pb2.RouteConfiguration(
        name=route_name,
        virtual_hosts=[
            route_components_pb2.VirtualHost(
                name=route_name,
                domains=["*"],
                routes=[
                    *forced,
                    route_components_pb2.Route(
                        match=route_components_pb2.RouteMatch(prefix=""), route=action
                    ),
                ],
            )
        ],
    )


def _forced_route(cluster: str, side: str) -> route_components_pb2.Route:
    """`x-spine-route: <side>` (exact) → `cluster`."""
    header = route_components_pb2.HeaderMatcher(
        name=ROUTE_HEADER, string_match=string_pb2.StringMatcher(exact=side))
    return route_components_pb2.Route(
        name=f"{ROUTE_HEADER}={side}",
        match=route_components_pb2.RouteMatch(prefix="", headers=[header]),
        route=route_components_pb2.RouteAction(cluster=cluster),
    )


def build_cluster(name: str) -> cluster_pb2.Cluster:
    """An EDS cluster whose endpoints come over the same ADS stream."""
    return cluster_pb2.Cluster(
        name=name,
        type=cluster_pb2.Cluster.EDS,
        eds_cluster_config=cluster_pb2.Cluster.EdsClusterConfig(eds_config=_ads_source(), service_name=name),
        lb_policy=cluster_pb2.Cluster.ROUND_ROBIN,
    )


def build_load_assignment(name: str, endpoints: Sequence[Endpoint]) -> endpoint_pb2.ClusterLoadAssignment:
    """One locality. gRPC NACKs a locality entry without `locality` and ignores one without
    `load_balancing_weight`, so both are always set."""
    locality = endpoint_components_pb2.LocalityLbEndpoints(
        locality=base_pb2.Locality(region="spine", zone=name),
        load_balancing_weight=wrappers_pb2.UInt32Value(value=1),
    )
    for ep in endpoints:
        locality.lb_endpoints.add(
            endpoint=endpoint_components_pb2.Endpoint(
                address=address_pb2.Address(
                    socket_address=address_pb2.SocketAddress(address=ep.host, port_value=ep.port)
                )
            ),
            health_status=health_check_pb2.HEALTHY if ep.healthy else health_check_pb2.UNHEALTHY,
        )
    return endpoint_pb2.ClusterLoadAssignment(cluster_name=name, endpoints=[locality])


def check_weights(weights: Mapping[str, int]) -> None:
    """Weights a data plane accepts: non-negative integers, total > 0 and within uint32."""
    if not weights:
        raise ConfigError("weights: at least one cluster is needed, got {}")
    for name, weight in weights.items():
        if isinstance(weight, bool) or not isinstance(weight, int) or weight < 0:
            raise ConfigError(f"weights.{name}: expected an integer >= 0, got {weight!r}")
    total = sum(weights.values())
    if total <= 0:
        raise ConfigError(
            f"weights: total must be > 0 (gRPC and Envoy reject an all-zero split), got {dict(weights)}"
        )
    if total > MAX_TOTAL_WEIGHT:
        raise ConfigError(f"weights: total {total} exceeds the limit {MAX_TOTAL_WEIGHT}")


def build_snapshot(
    service: str,
    weights: Mapping[str, int],
    endpoints: Mapping[str, Sequence[Endpoint]],
    version: str,
    *,
    route_header: bool = False,
) -> Snapshot:
    """All resources for `xds:///<service>` at one stage, checked for consistency.

    `route_header`: whether the route honours `x-spine-route` (see `build_route`). Where
    `endpoints` names the sides' HTTP APIs too (`layered-http`, `spine-http`), a second route,
    `<service>-http-route`, splits HTTP traffic between them by the same weights (the route
    Envoy's HTTP listener reads)."""
    if not service:
        raise ConfigError("service: must be a non-empty listener name")
    check_weights(weights)
    route_name = f"{service}-route"
    resources: dict[str, dict[str, pb_message.Message]] = {
        LISTENER: {service: build_listener(service, route_name)},
        ROUTE: {route_name: build_route(route_name, weights, route_header=route_header)},
        CLUSTER: {name: build_cluster(name) for name in endpoints},
        ENDPOINT: {name: build_load_assignment(name, eps) for name, eps in endpoints.items()},
    }
    http = {f"{side}{HTTP_SUFFIX}": weight for side, weight in weights.items() if f"{side}{HTTP_SUFFIX}" in endpoints}
    if http:
        http_route = f"{service}{HTTP_SUFFIX}-route"
        resources[ROUTE][http_route] = build_route(
            http_route, http, route_header=route_header,
            sides={cluster: cluster.removesuffix(HTTP_SUFFIX) for cluster in http})
    snapshot = Snapshot(version=version, resources=resources)
    snapshot.check()
    return snapshot


__all__ = [
    "CLUSTER",
    "ENDPOINT",
    "HTTP_SUFFIX",
    "LAYERED",
    "LISTENER",
    "ROUTE",
    "ROUTE_HEADER",
    "SPINE",
    "STAGE",
    "TYPE_NAMES",
    "TYPE_URLS",
    "Endpoint",
    "Snapshot",
    "build_cluster",
    "build_listener",
    "build_load_assignment",
    "build_route",
    "build_snapshot",
    "check_weights",
    "route_clusters",
]
