"""Property: the Envoy path and the Gateway path admit the same requests.

Two collapsed spines with the same config get the same sequence of requests: one through its
Gateway (`Generate`), the other the way Envoy's filters would ask it (ext_authz `Check`, and
when that allows, `ShouldRateLimit` for the tenant it names, the filter chain's order). Every
request gets the same verdict on both: admitted, refused by auth (UNAUTHENTICATED ↔ 401,
PERMISSION_DENIED ↔ 403) or refused by the rate limit (RESOURCE_EXHAUSTED ↔ OVER_LIMIT).

Credentials range over good and bad API keys and JWTs and malformed headers. Examples are
independent, so a failure shrinks to the request that differs: the API keys' tenants have
buckets no example can empty, and the rate limit is exercised on two JWT tenants made fresh
for each example, whose buckets hold 3 requests and refill at 1e-6/s (counts are exact).
Tenants are header-safe strings: one that cannot be a header value cannot be forwarded by
Envoy and is refused there (see test_envoy_authz).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from envoy.type.v3 import http_status_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.running_stack import RunningStack
from tests.conftest import DEV_KEY, TEST_OVERRIDES, TIGHT_KEY, config_for_tests, make_jwt, start_stack
from tests.envoy_calls import (
    ENVOY_LISTENER,
    OVER_LIMIT,
    check,
    descriptor,
    envoy_address,
    ok_headers,
    should_rate_limit,
)
from wire.v1 import gateway_pb2_grpc, generation_pb2

NO_SCOPE_KEY = "parity-no-scope-0000"
# Parity of decisions, not latency: a hop that misses the default 250 ms budget because the
# host runs the rest of the suite too (a fresh clone's full run failed once with "ratelimit
# unavailable (DEADLINE_EXCEEDED)" on the Envoy side, not reproduced on the retry) is the
# host's doing, so the hops get 2 s here.
CONFIG = config_for_tests(
    calls={"budgets_ms": dict.fromkeys(("auth", "ratelimit", "router", "cache"), 2000)},
    auth={"api_keys": [*TEST_OVERRIDES["auth"]["api_keys"],
                       {"id": "reader", "tenant": "reader", "key": NO_SCOPE_KEY, "scopes": ["read"]}]},
    ratelimit={"default": {"requests_per_second": 0.000001, "burst": 3, "tokens_per_minute": 6.0e9,
                           "token_burst": 1.0e9},
               "tenants": {tenant: {"burst": 1.0e9} for tenant in ("dev", "tight", "reader")}},
    envoy_api=ENVOY_LISTENER)
FRESH = itertools.count()


def credentials(fresh: str) -> dict[str, str | None]:
    """What a request may carry in `authorization` (None: nothing)."""
    return {
        "dev-key": f"Bearer {DEV_KEY}",
        "tight-key": f"Bearer {TIGHT_KEY}",
        "lowercase-scheme": f"bearer {DEV_KEY}",
        "no-scope-key": f"Bearer {NO_SCOPE_KEY}",
        "unknown-key": "Bearer not-a-key-at-all",
        "jwt-fresh": f"Bearer {make_jwt(fresh)}",
        "jwt-fresh-2": f"Bearer {make_jwt(fresh + '-2')}",
        "jwt-expired": f"Bearer {make_jwt(fresh, expires_in=-3600)}",
        "jwt-other-secret": f"Bearer {make_jwt(fresh, secret='not-the-configured-secret-0123456789')}",
        "jwt-no-scope": f"Bearer {make_jwt(fresh, scope='read')}",
        "basic-scheme": "Basic ZGV2OmRldg==",
        "no-scheme": DEV_KEY,
        "empty-bearer": "Bearer ",
        "missing": None,
    }


MODELS = (None, "tiny-lm", "tiny", "default")  # None: Envoy sends no model entry; the Gateway asks "default"
REQUESTS = st.lists(st.tuples(st.sampled_from(sorted(credentials("x"))), st.sampled_from(MODELS)),
                    min_size=1, max_size=10)


@pytest.fixture(scope="module")
def sides(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[grpc.Channel, grpc.Channel]]:
    tmp = tmp_path_factory.mktemp("envoy-parity")
    stacks: list[RunningStack] = []
    try:
        stacks = [start_stack("collapsed", tmp / side, CONFIG) for side in ("gateway", "envoy")]
        with grpc.insecure_channel(stacks[0].address) as gateway, grpc.insecure_channel(envoy_address(stacks[1])) as envoy:
            yield gateway, envoy
    finally:
        for stack in stacks:
            stack.stop()


def through_gateway(channel: grpc.Channel, authorization: str | None, model: str | None, n: int) -> str:
    metadata = [("authorization", authorization)] if authorization is not None else []
    request = generation_pb2.GenerateRequest(model=model or "default", prompt=f"parity {n}", max_tokens=1)
    try:
        gateway_pb2_grpc.GatewayStub(channel).Generate(request, metadata=metadata, timeout=30)
    except grpc.RpcError as error:
        return {grpc.StatusCode.UNAUTHENTICATED: "401", grpc.StatusCode.PERMISSION_DENIED: "403",
                grpc.StatusCode.RESOURCE_EXHAUSTED: "over-limit"}.get(error.code(), f"{error.code()}: {error.details()}")
    return "admitted"


def through_envoy(channel: grpc.Channel, authorization: str | None, model: str | None) -> str:
    answer = check(channel, {"authorization": authorization} if authorization is not None else {})
    if answer.status.code:
        return {http_status_pb2.Unauthorized: "401", http_status_pb2.Forbidden: "403"}.get(
            answer.denied_response.status.code, str(answer.denied_response.status.code))
    tenant = ok_headers(answer)["x-spine-tenant"].header.value
    entries = [("tenant", tenant)] + ([("model", model)] if model is not None else [])
    verdict = should_rate_limit(channel, [descriptor(*entries)]).overall_code
    return "over-limit" if verdict == OVER_LIMIT else "admitted"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=REQUESTS)
def test_the_envoy_path_and_the_gateway_path_admit_the_same_requests(
        sides: tuple[grpc.Channel, grpc.Channel], requests: list[tuple[str, str | None]]) -> None:
    gateway, envoy = sides
    offered = credentials(f"fresh-{next(FRESH)}")
    for n, (kind, model) in enumerate(requests):
        authorization = offered[kind]
        by_gateway = through_gateway(gateway, authorization, model, n)
        by_envoy = through_envoy(envoy, authorization, model)
        assert by_gateway == by_envoy, f"request {n} ({kind}, model {model})"


def test_the_property_sees_every_verdict(sides: tuple[grpc.Channel, grpc.Channel], tmp_path: Path) -> None:
    """The property is not vacuous: each verdict occurs on both paths."""
    gateway, envoy = sides
    offered = credentials(f"fresh-{next(FRESH)}")
    plan = [("jwt-fresh", None)] * 4 + [("unknown-key", "tiny"), ("no-scope-key", "tiny-lm")]
    verdicts = [(through_gateway(gateway, offered[kind], model, n), through_envoy(envoy, offered[kind], model))
                for n, (kind, model) in enumerate(plan)]
    assert verdicts == [("admitted",) * 2] * 3 + [("over-limit",) * 2, ("401",) * 2, ("403",) * 2]
