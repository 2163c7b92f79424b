"""Where Envoy's APIs are served: on a listener of their own (`envoy_api.listen`) of a spine or
gateway, never on its public Gateway listener; on the auth and ratelimit processes of the
layered layout; and on a spine mid-migration, where the answer follows the component's
placement."""

from __future__ import annotations

from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import DEV_KEY, TEST_OVERRIDES, config_for_tests, start_stack
from tests.envoy_calls import (
    AUTHZ,
    ENVOY_LISTENER,
    OK,
    OVER_LIMIT,
    RLS,
    bearer,
    check,
    envoy_address,
    ok_headers,
    services,
    tenant_limit,
)

MOVING = {"requests_per_second": 0.001, "burst": 3}
CONFIG = config_for_tests(ratelimit={"tenants": {**TEST_OVERRIDES["ratelimit"]["tenants"], "moving": MOVING}},
                          envoy_api=ENVOY_LISTENER)


def test_the_envoy_listener_serves_the_envoy_apis_alone_and_the_gateways_none(tmp_path: Path) -> None:
    stack = start_stack("collapsed", tmp_path, CONFIG)
    try:
        with grpc.insecure_channel(stack.address) as gateway, grpc.insecure_channel(envoy_address(stack)) as envoy:
            assert AUTHZ not in services(gateway) and RLS not in services(gateway)
            assert {AUTHZ, RLS, "grpc.health.v1.Health"} <= services(envoy) and "spine.v1.Gateway" not in services(envoy)
            health = health_pb2_grpc.HealthStub(envoy)
            for service in ("", AUTHZ, RLS):
                reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            assert ok_headers(check(envoy, bearer(DEV_KEY)))["x-spine-tenant"].header.value == "dev"
            assert tenant_limit(envoy, "dev").overall_code == OK
    finally:
        stack.stop()
    assert stack.envoy_server is None


def test_by_default_no_process_of_a_spine_serves_them(tmp_path: Path) -> None:
    stack = start_stack("collapsed", tmp_path, config_for_tests())
    try:
        assert stack.envoy_server is None
        with grpc.insecure_channel(stack.address) as channel:
            assert not {AUTHZ, RLS} & services(channel)
    finally:
        stack.stop()


def test_envoy_api_enabled_false_serves_neither_even_with_a_listener(tmp_path: Path) -> None:
    stack = start_stack("collapsed", tmp_path, config_for_tests(envoy_api={"enabled": False, **ENVOY_LISTENER}))
    try:
        assert stack.envoy_server is None
        with grpc.insecure_channel(stack.address) as channel:
            assert not {AUTHZ, RLS} & services(channel)
    finally:
        stack.stop()


def test_layered_processes_serve_their_envoy_api_and_a_spine_answers_from_where_the_component_is(
        tmp_path: Path) -> None:
    """Auth and ratelimit in their own processes (the layered side's), the rest in the spine."""
    stack = start_stack("mixed", tmp_path, config_for_tests(
        placements={"auth": "remote", "ratelimit": "remote"},
        ratelimit={"tenants": {**TEST_OVERRIDES["ratelimit"]["tenants"], "moving": MOVING}}, envoy_api=ENVOY_LISTENER))
    try:
        assert stack.supervisor is not None
        auth_address = stack.supervisor.children["auth"].address
        ratelimit_address = stack.supervisor.children["ratelimit"].address
        with grpc.insecure_channel(auth_address) as auth, grpc.insecure_channel(ratelimit_address) as ratelimit, \
                grpc.insecure_channel(envoy_address(stack)) as spine:
            assert {AUTHZ, "spine.v1.Auth"} <= services(auth) and RLS not in services(auth)
            assert {RLS, "spine.v1.RateLimit"} <= services(ratelimit) and AUTHZ not in services(ratelimit)
            assert ok_headers(check(auth, bearer(DEV_KEY)))["x-spine-tenant"].header.value == "dev"
            # One bucket, the ratelimit process's, whether Envoy asks it or the spine.
            remaining = [tenant_limit(ratelimit, "moving").statuses[0].limit_remaining,
                         tenant_limit(spine, "moving").statuses[0].limit_remaining,
                         tenant_limit(ratelimit, "moving").statuses[0].limit_remaining]
            assert remaining == [2, 1, 0]
            assert tenant_limit(spine, "moving").overall_code == OVER_LIMIT
            stack.set_placements({"ratelimit": "local"})  # the spine's own buckets from now on
            assert tenant_limit(spine, "moving").statuses[0].limit_remaining == 2
            assert tenant_limit(ratelimit, "moving").overall_code == OVER_LIMIT
    finally:
        stack.stop()
