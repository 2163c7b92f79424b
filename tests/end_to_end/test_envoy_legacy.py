"""A team's existing ext_authz and rate limit services as the layered side's auth and ratelimit.

The legacy services run in their own process (`tests/legacy_envoy_services.py`: Envoy's
protocols only, nothing of spine). A placement `{remote: HOST:PORT, protocol: ...}` binds the
component to them; the pipeline still calls its own batch rpcs, translated into `Check` and
`ShouldRateLimit`. Placing the component local moves the decision into the spine, live.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from runtime.placement.remote import Guarded
from runtime.running_stack import RunningStack
from services.auth.api import AUTH
from services.auth.envoy_authz import EnvoyAuthzClient
from services.pipeline.batch_rpc import ItemError
from services.pipeline.interface import CallOptions
from services.ratelimit.admission import AdmitItem, AdmitVerdict
from services.ratelimit.api import RATELIMIT
from services.ratelimit.envoy_ratelimit import EnvoyRlsClient
from spine.client.gateway_client import CallResult, GatewayClient
from tests.conftest import DEV_KEY, config_for_tests, start_stack
from tests.envoy_calls import (
    AUTHZ,
    ENVOY_LISTENER,
    OVER_LIMIT,
    RLS,
    bearer,
    check,
    envoy_address,
    legacy_services,
    ok_headers,
    tenant_limit,
)
from tests.waiting import eventually
from wire.v1 import generation_pb2, ratelimit_pb2

LEGACY_KEY, BOUNDED_KEY, FORBIDDEN_KEY = "legacy-key-1", "legacy-key-2", "legacy-forbidden"
LEGACY_ARGS = ("--key", f"{LEGACY_KEY}=acme", "--key", f"{BOUNDED_KEY}=bounded", "--key", f"{FORBIDDEN_KEY}=acme",
               "--forbid", FORBIDDEN_KEY, "--limit", "3", "--window-s", "600", "--domain", "legacy",
               "--tenant-header", "x-legacy-tenant")


def legacy_config(address: str, **extra: Any) -> dict[str, Any]:
    return config_for_tests(placements={
        "auth": {"remote": address, "protocol": "envoy-ext-authz", "tenant_header": "x-legacy-tenant"},
        "ratelimit": {"remote": address, "protocol": "envoy-rls", "domain": "legacy"},
    }, **extra)


@pytest.fixture(scope="module")
def legacy() -> Iterator[str]:
    with legacy_services(*LEGACY_ARGS) as (address, _):
        yield address


@pytest.fixture(scope="module")
def spine(legacy: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    stack = start_stack("mixed", tmp_path_factory.mktemp("envoy-legacy"), legacy_config(legacy, envoy_api=ENVOY_LISTENER))
    yield stack
    stack.stop()


def generate(stack: RunningStack, token: str, prompt: str = "hello legacy") -> CallResult:
    with GatewayClient(stack.address) as client:
        return client.generate(generation_pb2.GenerateRequest(model="tiny-lm", prompt=prompt, max_tokens=1),
                               token=token)


def test_the_placement_binds_the_components_to_the_legacy_services(spine: RunningStack, legacy: str) -> None:
    assert spine.placements["auth"] == spine.placements["ratelimit"] == "remote"
    for reached, client in ((spine.component(AUTH), EnvoyAuthzClient), (spine.component(RATELIMIT), EnvoyRlsClient)):
        assert isinstance(reached, Guarded) and isinstance(reached.implementation, client)
    assert legacy in spine.health_report()["components"]["auth"]["reason"]
    assert spine.supervisor is None  # nothing of spine's own was spawned for them


def test_a_legacy_key_is_served_with_the_tenant_the_legacy_service_names(spine: RunningStack) -> None:
    result = generate(spine, LEGACY_KEY)
    assert result.ok, result.details
    with grpc.insecure_channel(envoy_address(spine)) as channel:  # Envoy asking the spine gets the legacy answer
        assert ok_headers(check(channel, bearer(LEGACY_KEY)))["x-spine-tenant"].header.value == "acme"


@pytest.mark.parametrize(("token", "code", "details"), [
    ("no-such-key", grpc.StatusCode.UNAUTHENTICATED, "legacy: unknown key"),
    (DEV_KEY, grpc.StatusCode.UNAUTHENTICATED, "legacy: unknown key"),  # the spine's own key: not yet
    (FORBIDDEN_KEY, grpc.StatusCode.PERMISSION_DENIED, "legacy: this key may not call the model"),
], ids=["unknown", "spine-dev-key", "forbidden"])
def test_the_legacy_service_denies_with_its_own_reason(spine: RunningStack, token: str, code: grpc.StatusCode,
                                                       details: str) -> None:
    result = generate(spine, token)
    assert (result.code, result.details) == (code, details)


def test_the_legacy_rate_limit_refuses_past_its_limit_with_a_retry_after(spine: RunningStack) -> None:
    results = [generate(spine, BOUNDED_KEY, f"bounded {i}") for i in range(4)]
    assert [r.code for r in results] == [grpc.StatusCode.OK] * 3 + [grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert "legacy_per_tenant" in results[3].details
    assert 0 < float(results[3].trailing["retry-after"]) <= 600
    with grpc.insecure_channel(envoy_address(spine)) as channel:  # the same legacy counter, through the spine's Envoy API
        assert tenant_limit(channel, "bounded").overall_code == OVER_LIMIT


def test_a_foreign_rate_limiter_cannot_take_a_share_and_says_so(spine: RunningStack) -> None:
    assert spine.component(RATELIMIT).set_share(0.25, CallOptions(timeout=1)) == 1.0


def test_the_gateway_health_reads_the_legacy_services_own_health(spine: RunningStack) -> None:
    report = spine.health_report()
    assert report["serving"] is True
    reason = report["components"]["auth"]["reason"]
    assert "envoy-ext-authz service at" in reason and reason.endswith("SERVING")


def test_placing_them_local_moves_the_decision_into_the_spine_live(spine: RunningStack) -> None:
    try:
        spine.set_placements({"auth": "local", "ratelimit": "local"})
        assert (generate(spine, LEGACY_KEY).code, generate(spine, DEV_KEY).code) == (
            grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.OK)
        with grpc.insecure_channel(envoy_address(spine)) as channel:
            assert ok_headers(check(channel, bearer(DEV_KEY)))["x-spine-tenant"].header.value == "dev"
            assert check(channel, bearer(LEGACY_KEY)).status.code == grpc.StatusCode.UNAUTHENTICATED.value[0]
    finally:
        spine.set_placements({"auth": "remote", "ratelimit": "remote"})
    assert generate(spine, LEGACY_KEY).ok  # and back to the legacy services, without a restart
    assert isinstance(spine.component(AUTH), Guarded)


def test_a_layered_stack_with_legacy_services_spawns_none_of_its_own(tmp_path: Path) -> None:
    """The layered layout: the legacy services are its auth and ratelimit; one without a health
    service is up while it answers, and when it goes away the gateway says NOT_SERVING."""
    with legacy_services(*LEGACY_ARGS, "--no-health") as (address, process):
        stack = start_stack("layered", tmp_path, legacy_config(address, envoy_api=ENVOY_LISTENER))
        try:
            assert stack.supervisor is not None and stack.envoy_server is not None
            assert set(stack.supervisor.children) == {"router", "cache", "metrics", "logs", "inference"}
            assert generate(stack, LEGACY_KEY).ok
            assert "no health service" in stack.health_report()["components"]["ratelimit"]["reason"]
            envoy_listener = stack.envoy_server.address
            assert [health(envoy_listener, service) for service in ("", AUTHZ, RLS)] == ["SERVING"] * 3
            process.terminate()
            process.wait(timeout=10)
            assert eventually(lambda: stack.health_report()["serving"] is False)
            assert "auth" in stack.health_report()["reason"]
            result = generate(stack, LEGACY_KEY)
            assert result.code == grpc.StatusCode.UNAVAILABLE and "auth unavailable" in result.details
            # What Envoy's active health check of the spine's Envoy listener sees.
            assert eventually(lambda: health(envoy_listener, "") == "NOT_SERVING")
            assert [health(envoy_listener, service) for service in (AUTHZ, RLS)] == ["NOT_SERVING"] * 2
        finally:
            stack.stop()


def health(address: str, service: str) -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def test_the_interface_through_a_foreign_client_answers_like_the_components_own(spine: RunningStack) -> None:
    """check / admit and the descriptor form, over the legacy protocol."""
    auth, ratelimit, options = spine.component(AUTH), spine.component(RATELIMIT), CallOptions(timeout=5)
    [accepted, denied] = auth.check([LEGACY_KEY, "no-such-key"], options)
    assert not isinstance(accepted, ItemError) and accepted.principal.tenant == "acme"
    assert denied == ItemError(grpc.StatusCode.UNAUTHENTICATED, "legacy: unknown key")
    [invalid] = ratelimit.admit([AdmitItem("", "tiny-lm", 1)], options)
    assert isinstance(invalid, ItemError) and invalid.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "tenant" in invalid.message
    # A shadow copy is admitted without asking: the legacy counter of a spent tenant does not refuse it.
    ratelimit.admit([AdmitItem("spent", "tiny-lm", 1) for _ in range(4)], options)
    [refused, shadow] = ratelimit.admit([AdmitItem("spent", "tiny-lm", 0), AdmitItem("spent", "tiny-lm", 0, dry_run=True)],
                                        options)
    assert isinstance(refused, AdmitVerdict) and not refused.admitted
    assert isinstance(shadow, AdmitVerdict) and shadow.admitted
    Entry = ratelimit_pb2.RateLimitDescriptor.Entry
    answer = ratelimit.should_rate_limit(ratelimit_pb2.RateLimitRequest(domain="spine", descriptors=[
        ratelimit_pb2.RateLimitDescriptor(entries=[Entry(key="tenant", value="spent"), Entry(key="model", value="tiny-lm"),
                                                   Entry(key="resource", value="requests")])]), options)
    assert answer.overall_code == ratelimit_pb2.RateLimitResponse.OVER_LIMIT  # the same legacy counter
    assert answer.statuses[0].limit_name == "legacy_per_tenant" and answer.retry_after_s > 0
