"""The spine as Envoy's rate limit service: `ShouldRateLimit` on a collapsed spine's Envoy listener
decides on the very buckets Gateway traffic is charged to, in Envoy's shape, and answers bad
input with Envoy-shaped codes (UNKNOWN, OVER_LIMIT), never an error."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from runtime.running_stack import RunningStack
from spine.client.gateway_client import GatewayClient
from tests.conftest import TEST_OVERRIDES, TIGHT_KEY, config_for_tests, start_stack
from tests.envoy_calls import (
    ENVOY_LISTENER,
    OK,
    OVER_LIMIT,
    UNKNOWN,
    descriptor,
    envoy_address,
    error_of,
    should_rate_limit,
    tenant_limit,
)
from wire.v1 import generation_pb2

# Buckets that barely refill during a test (0.001/s), so counts are exact.
SLOW = {"requests_per_second": 0.001, "tokens_per_minute": 60, "token_burst": 100}
CONFIG = config_for_tests(ratelimit={"tenants": {
    **TEST_OVERRIDES["ratelimit"]["tenants"],
    "envoy-a": {**SLOW, "burst": 3}, "envoy-b": {**SLOW, "burst": 5}, "envoy-c": {**SLOW, "burst": 2},
    "envoy-d": {**SLOW, "burst": 10}, "envoy-g": {**SLOW, "burst": 10}, "envoy-e": {**SLOW, "burst": 10}, "envoy-f": {**SLOW, "burst": 10},
}}, envoy_api=ENVOY_LISTENER)


@pytest.fixture(scope="module")
def spine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    stack = start_stack("collapsed", tmp_path_factory.mktemp("envoy-rls"), CONFIG)
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def channel(spine: RunningStack) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(envoy_address(spine)) as channel:
        yield channel


def level(spine: RunningStack, tenant: str) -> float | None:
    bucket = spine.local_servicers["ratelimit"].bucket((("tenant", tenant), ("model", "tiny-lm"),
                                                        ("resource", "requests")))
    return None if bucket is None else bucket.level


def test_a_tenant_is_ok_until_its_burst_then_over_limit(channel: grpc.Channel) -> None:
    answers = [tenant_limit(channel, "envoy-a") for _ in range(4)]
    assert [a.overall_code for a in answers] == [OK, OK, OK, OVER_LIMIT]
    assert [a.statuses[0].limit_remaining for a in answers] == [2, 1, 0, 0]
    ok, over = answers[0].statuses[0], answers[3].statuses[0]
    assert ok.current_limit.name == "tenant=envoy-a,model=tiny-lm,resource=requests"
    # OK: the time until the bucket is full again (1 token at 0.001/s); OVER_LIMIT: until 1 fits.
    assert ok.duration_until_reset.ToTimedelta().total_seconds() == pytest.approx(1000, rel=0.01)
    assert over.duration_until_reset.ToTimedelta().total_seconds() == pytest.approx(1000, rel=0.01)
    assert {h.key: h.value for h in answers[3].response_headers_to_add}["retry-after"].startswith("99")
    assert not answers[0].response_headers_to_add


def test_the_current_limit_is_given_in_the_smallest_whole_unit(channel: grpc.Channel) -> None:
    from envoy.service.ratelimit.v3 import rls_pb2

    limit = tenant_limit(channel, "some-new-tenant").statuses[0].current_limit  # the default: 200/s
    assert (limit.requests_per_unit, limit.unit) == (200, rls_pb2.RateLimitResponse.RateLimit.SECOND)
    limit = tenant_limit(channel, "envoy-g").statuses[0].current_limit  # 0.001/s = 3.6/h
    assert (limit.requests_per_unit, limit.unit) == (4, rls_pb2.RateLimitResponse.RateLimit.HOUR)


def test_envoy_and_the_gateway_draw_on_the_same_bucket(spine: RunningStack, channel: grpc.Channel) -> None:
    """`tight` (burst 4): Envoy takes three, the Gateway gets the fourth, then both are refused."""
    assert [tenant_limit(channel, "tight").overall_code for _ in range(3)] == [OK, OK, OK]
    with GatewayClient(spine.address) as client:
        request = generation_pb2.GenerateRequest(model="tiny-lm", prompt="shared bucket", max_tokens=1)
        assert client.generate(request, token=TIGHT_KEY).code == grpc.StatusCode.OK
        refused = client.generate(request, token=TIGHT_KEY)
    assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tenant=tight,model=tiny-lm,resource=requests" in refused.details
    assert tenant_limit(channel, "tight").overall_code == OVER_LIMIT


def test_a_model_alias_names_the_same_bucket_as_its_id(channel: grpc.Channel) -> None:
    by_alias = should_rate_limit(channel, [descriptor(("tenant", "envoy-b"), ("model", "tiny"))])
    by_id = should_rate_limit(channel, [descriptor(("tenant", "envoy-b"), ("model", "tiny-lm"))])
    default = tenant_limit(channel, "envoy-b")
    assert [a.statuses[0].limit_remaining for a in (by_alias, by_id, default)] == [4, 3, 2]


def test_hits_addend_is_the_cost_the_descriptors_own_before_the_requests(channel: grpc.Channel) -> None:
    assert tenant_limit(channel, "envoy-d", hits_addend=4).statuses[0].limit_remaining == 6
    both = should_rate_limit(channel, [descriptor(("tenant", "envoy-d"), hits=3)], hits_addend=5)
    assert both.statuses[0].limit_remaining == 3
    assert tenant_limit(channel, "envoy-d", hits_addend=0).statuses[0].limit_remaining == 2  # 0 means 1


def test_descriptors_are_all_or_nothing(channel: grpc.Channel) -> None:
    answer = should_rate_limit(channel, [descriptor(("tenant", "envoy-e"), hits=4),
                                         descriptor(("tenant", "envoy-f"), hits=11)])
    assert answer.overall_code == OVER_LIMIT
    assert [s.code for s in answer.statuses] == [OK, OVER_LIMIT]
    assert tenant_limit(channel, "envoy-e").statuses[0].limit_remaining == 9  # the 4 were not charged


def test_the_tokens_resource_is_the_bucket_gateway_tokens_are_charged_to(channel: grpc.Channel) -> None:
    answer = should_rate_limit(channel, [descriptor(("tenant", "envoy-c"), ("resource", "tokens"), hits=60)])
    assert answer.overall_code == OK
    assert answer.statuses[0].current_limit.name == "tenant=envoy-c,model=tiny-lm,resource=tokens"
    assert answer.statuses[0].limit_remaining == 40


def test_an_unknown_tenant_has_the_default_limits_as_on_the_gateway_path(channel: grpc.Channel) -> None:
    answer = tenant_limit(channel, "never-configured")
    assert answer.overall_code == OK and answer.statuses[0].limit_remaining == 399  # default burst 400


@pytest.mark.parametrize(("domain", "descriptors", "reason"), [
    ("", [descriptor(("tenant", "envoy-c"))], "domain: expected 'spine', got empty"),
    ("other", [descriptor(("tenant", "envoy-c"))], "domain: expected 'spine', got 'other'"),
    ("spine", [], "descriptors: at least one descriptor is required"),
    ("spine", [descriptor()], "descriptors[0]: needs a non-empty 'tenant' entry"),
    ("spine", [descriptor(("tenant", ""))], "descriptors[0]: needs a non-empty 'tenant' entry"),
    ("spine", [descriptor(("tenant", "envoy-c")), descriptor(("remote_address", "10.0.0.1"))],
     "descriptors[1]: unknown entry key 'remote_address'"),
    ("spine", [descriptor(("tenant", "envoy-c"), ("tenant", "dev"))], "descriptors[0]: entry 'tenant' given twice"),
    ("spine", [descriptor(("tenant", "envoy-c"), ("model", "gpt-9"))], "descriptors[0].model: unknown model 'gpt-9'"),
    ("spine", [descriptor(("tenant", "envoy-c"), ("resource", "bytes"))], "descriptors[0].resource: expected one of"),
], ids=["empty-domain", "other-domain", "no-descriptors", "no-entries", "empty-tenant", "foreign-key",
        "repeated-key", "unknown-model", "unknown-resource"])
def test_a_request_that_cannot_be_decided_is_unknown_with_the_reason(
        spine: RunningStack, channel: grpc.Channel, domain: str, descriptors: list, reason: str) -> None:  # type: ignore[type-arg]
    before = level(spine, "envoy-c")
    answer = should_rate_limit(channel, descriptors, domain=domain)
    assert answer.overall_code == UNKNOWN and not answer.statuses
    assert reason in error_of(answer)
    assert level(spine, "envoy-c") == before  # nothing was charged


@pytest.mark.parametrize(("hits", "hits_addend"), [
    (2**64 - 1, 0),  # -1 in a client's int64, sent unsigned
    (None, 2**32 - 1),  # -1 in the request-level uint32
    (2**40 + 1, 0),
    (11, 0),  # more than envoy-f's burst of 10
], ids=["negative-descriptor-hits", "negative-request-hits", "huge", "over-burst"])
def test_a_cost_no_bucket_can_ever_hold_is_over_limit_without_a_reset(
        channel: grpc.Channel, hits: int | None, hits_addend: int) -> None:
    answer = should_rate_limit(channel, [descriptor(("tenant", "envoy-f"), hits=hits)], hits_addend=hits_addend)
    assert answer.overall_code == OVER_LIMIT
    assert not answer.statuses[0].HasField("duration_until_reset")
    assert "can ever hold" in error_of(answer) or "more than any bucket holds" in error_of(answer)
    assert tenant_limit(channel, "envoy-f").overall_code == OK  # the service keeps serving


def test_no_room_for_a_new_bucket_is_over_limit_not_an_error(tmp_path: Path) -> None:
    """A device budget with room for 64 buckets (what a layered ratelimit process serves, on
    its own servicer): the 65th tenant is refused OVER_LIMIT, the known ones still decided."""
    from monolith.device import DeviceContext
    from runtime.placement.foreign import envoy_apis_of
    from runtime.server import start_server
    from services.ratelimit.config import RateLimitConfig
    from services.ratelimit.service import RateLimitService
    from services.registry import DEFAULT

    spec = DEFAULT["ratelimit"]
    servicer = RateLimitService(RateLimitConfig(), DeviceContext(budget_bytes=8 * 1024))
    server = start_server([(spec, servicer), *envoy_apis_of(spec, servicer, CONFIG)], f"unix:{tmp_path}/rls.sock")
    try:
        with grpc.insecure_channel(server.address) as channel:
            answers = [tenant_limit(channel, f"t{i}") for i in range(65)]
            assert [a.overall_code for a in answers] == [OK] * 64 + [OVER_LIMIT]
            assert "no room for a new bucket" in error_of(answers[-1])
            assert tenant_limit(channel, "t0").overall_code == OK
    finally:
        server.stop(0)
