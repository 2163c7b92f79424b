"""The thin Envoy at the edge (`deploy/envoy/edge-*.yaml`) and its plan (`deploy/plans/envoy-edge.yaml`).

The bootstraps are parsed strictly into Envoy's protos (`tests/integration/test_deploy_configs.py` parses
every file); these tests check what they must say to work with the spine: the filters point
at the spine's Envoy APIs and fail closed, a client's `x-spine-tenant` is stripped before
ext_authz sets it, and the descriptor the route builds is one a real spine decides on.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.config.core.v3 import health_check_pb2
from envoy.extensions.filters.http.basic_auth.v3 import basic_auth_pb2
from envoy.extensions.filters.http.ext_authz.v3 import ext_authz_pb2
from envoy.extensions.filters.http.header_mutation.v3 import header_mutation_pb2
from envoy.extensions.filters.http.ratelimit.v3 import rate_limit_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2
from envoy.extensions.transport_sockets.tls.v3 import tls_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2

from migration.plan import load_plan
from runtime.config.file import load_config
from runtime.running_stack import RunningStack
from services.auth.envoy_authz import TENANT_HEADER
from services.ratelimit.envoy_ratelimit import ENTRY_KEYS
from tests.conftest import DEV_KEY, start_stack
from tests.envoy_calls import (
    ENVOY_LISTENER,
    OK,
    bearer,
    check,
    descriptor,
    envoy_address,
    ok_headers,
    should_rate_limit,
)
from tests.integration.test_deploy_configs import DEPLOY, load_bootstrap

EDGE_DECISIONS = DEPLOY / "envoy" / "edge-decisions.yaml"
EDGE_TLS = DEPLOY / "envoy" / "edge-tls.yaml"
ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
BASIC_AUTH = "type.googleapis.com/envoy.extensions.filters.http.basic_auth.v3.BasicAuth"


def connection_manager(bootstrap: bootstrap_pb2.Bootstrap) -> http_connection_manager_pb2.HttpConnectionManager:
    (listener,) = bootstrap.static_resources.listeners
    hcm = http_connection_manager_pb2.HttpConnectionManager()
    assert listener.filter_chains[0].filters[0].typed_config.Unpack(hcm)
    return hcm


def filter_config(hcm: http_connection_manager_pb2.HttpConnectionManager, name: str, message: Any) -> Any:
    (found,) = [f for f in hcm.http_filters if f.name == name]
    assert found.typed_config.Unpack(message), f"{name} is not a {type(message).__name__}"
    return message


@pytest.fixture(scope="module")
def decisions() -> bootstrap_pb2.Bootstrap:
    return load_bootstrap(EDGE_DECISIONS)


@pytest.mark.parametrize("path", [EDGE_DECISIONS, EDGE_TLS], ids=lambda p: p.name)
def test_the_edge_terminates_tls_for_http2(path: Path) -> None:
    (listener,) = load_bootstrap(path).static_resources.listeners
    (chain,) = listener.filter_chains
    tls = tls_pb2.DownstreamTlsContext()
    assert chain.transport_socket.typed_config.Unpack(tls)
    assert list(tls.common_tls_context.alpn_protocols) == ["h2"]
    (certificate,) = tls.common_tls_context.tls_certificates
    assert certificate.certificate_chain.filename and certificate.private_key.filename


def test_the_filters_strip_then_authorize_then_rate_limit_then_route(decisions: bootstrap_pb2.Bootstrap) -> None:
    hcm = connection_manager(decisions)
    assert [f.name for f in hcm.http_filters] == [
        "envoy.filters.http.header_mutation", "envoy.filters.http.ext_authz", "envoy.filters.http.ratelimit",
        "envoy.filters.http.router"]
    assert hcm.http_filters[-1].typed_config.type_url == ROUTER
    mutation = filter_config(hcm, "envoy.filters.http.header_mutation", header_mutation_pb2.HeaderMutation())
    assert [m.remove for m in mutation.mutations.request_mutations] == [TENANT_HEADER]


def test_both_filters_ask_the_spines_envoy_apis_and_fail_closed(decisions: bootstrap_pb2.Bootstrap) -> None:
    hcm = connection_manager(decisions)
    authz = filter_config(hcm, "envoy.filters.http.ext_authz", ext_authz_pb2.ExtAuthz())
    limit = filter_config(hcm, "envoy.filters.http.ratelimit", rate_limit_pb2.RateLimit())
    assert authz.grpc_service.envoy_grpc.cluster_name == limit.rate_limit_service.grpc_service.envoy_grpc.cluster_name
    assert not authz.failure_mode_allow and limit.failure_mode_deny
    assert limit.rate_limited_as_resource_exhausted  # RESOURCE_EXHAUSTED, what the Gateway answers
    assert limit.domain == load_config().ratelimit.domain
    clusters = {c.name: c for c in decisions.static_resources.clusters}
    spine = clusters[authz.grpc_service.envoy_grpc.cluster_name]
    options = http_protocol_options_pb2.HttpProtocolOptions()
    assert spine.typed_extension_protocol_options[
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"].Unpack(options)
    assert options.explicit_http_config.HasField("http2_protocol_options")  # gRPC needs HTTP/2
    (health,) = spine.health_checks
    assert isinstance(health, health_check_pb2.HealthCheck) and health.HasField("grpc_health_check")


def route_actions(bootstrap: bootstrap_pb2.Bootstrap) -> list[tuple[str, str]]:
    """(header, descriptor key) of every rate limit action on the route."""
    (host,) = connection_manager(bootstrap).route_config.virtual_hosts
    (route,) = host.routes
    return [(action.request_headers.header_name, action.request_headers.descriptor_key)
            for limit in route.route.rate_limits for action in limit.actions]


def test_the_route_builds_the_tenant_descriptor_from_the_header_ext_authz_sets(
        decisions: bootstrap_pb2.Bootstrap) -> None:
    actions = route_actions(decisions)
    assert actions == [(TENANT_HEADER, "tenant")]
    assert all(key in ENTRY_KEYS for _, key in actions)


@pytest.fixture(scope="module")
def spine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    # The default config, with the Envoy listener the edge config asks (its own port, as in the runbook).
    stack = start_stack("collapsed", tmp_path_factory.mktemp("edge"), load_config(overrides={"envoy_api": ENVOY_LISTENER}))
    yield stack
    stack.stop()


def test_what_envoy_would_send_is_decided_by_a_real_spine(decisions: bootstrap_pb2.Bootstrap, spine: RunningStack) -> None:
    """Check the dev key as ext_authz does, build the descriptor from the header it set as the
    route's actions do, ask ShouldRateLimit in the filter's domain: OK."""
    hcm = connection_manager(decisions)
    domain = filter_config(hcm, "envoy.filters.http.ratelimit", rate_limit_pb2.RateLimit()).domain
    with grpc.insecure_channel(envoy_address(spine)) as channel:
        upstream = {key: option.header.value for key, option in ok_headers(check(channel, bearer(DEV_KEY))).items()}
        entries = [(key, upstream[header]) for header, key in route_actions(decisions)]
        answer = should_rate_limit(channel, [descriptor(*entries)], domain=domain)
    assert entries == [("tenant", "dev")] and answer.overall_code == OK


def test_at_the_end_envoy_only_terminates_tls_and_keeps_basic_auth() -> None:
    """The thin Envoy a finished migration leaves: TLS and basic auth, no decision, cache or retry of its own; basic
    auth on a header of its own, so the Gateway's `authorization: Bearer` passes untouched."""
    hcm = connection_manager(load_bootstrap(EDGE_TLS))
    assert [f.typed_config.type_url for f in hcm.http_filters] == [BASIC_AUTH, ROUTER]
    basic = filter_config(hcm, "envoy.filters.http.basic_auth", basic_auth_pb2.BasicAuth())
    assert basic.users.filename and basic.authentication_header not in ("", "authorization")


def test_the_edge_plan_walks_from_the_legacy_services_to_the_spine() -> None:
    plan = load_plan((DEPLOY / "plans" / "envoy-edge.yaml").read_text())
    first, last = plan.stages[0], plan.stages[-1]
    assert first.spine_weight == 0 and set(first.placements.values()) == {"remote"}
    assert last.spine_weight == 100 and set(last.placements.values()) == {"local"}
    moved = {}
    for stage in plan.stages:
        for name, placement in stage.placements.items():
            if placement == "local":
                moved.setdefault(name, stage)
    assert plan.stages.index(moved["ratelimit"]) < plan.stages.index(moved["auth"])  # the cheaper undo first
    assert moved["ratelimit"].manual_approval and moved["auth"].manual_approval and last.manual_approval
    assert [s.spine_weight for s in plan.stages] == sorted(s.spine_weight for s in plan.stages)
