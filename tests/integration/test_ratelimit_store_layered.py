"""The layered layout's rate limiter with a shared store (`ratelimit.store`): the limiter runs
as its own gRPC server (`python -m runtime.process ratelimit`), so its lease state is in
that process; it serves the store's families on its own /metrics
(`runtime.observability.store_metrics`) and the stack's /metrics (the metrics component's process)
forwards them, as the collapsed spine shows its own. A real `redis-server` on loopback.
"""

from __future__ import annotations

import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from runtime.observability.store_metrics import ADDRESS_FILE
from runtime.running_stack import RunningStack
from spine.client.gateway_client import GatewayClient
from spine.tools.local_redis import LocalRedis
from tests.conftest import DEV_KEY, config_for_tests, start_stack
from tests.waiting import eventually
from wire.v1 import generation_pb2

STORE_FAMILIES = {"spine_ratelimit_store_leasing", "spine_ratelimit_store_calls", "spine_ratelimit_store_fallbacks",
                  "spine_ratelimit_store_recoveries", "spine_ratelimit_store_restarts",
                  "spine_ratelimit_store_replicas", "spine_ratelimit_store_leased_tokens",
                  "spine_ratelimit_store_leased_slots"}


@pytest.fixture(scope="module")
def layered(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningStack, LocalRedis]]:
    tmp = tmp_path_factory.mktemp("store-layered")
    with LocalRedis(tmp / "redis") as redis_server:
        config = config_for_tests(ratelimit={"store": {
            "redis": {"address": redis_server.address, "key_prefix": f"l{uuid.uuid4().hex[:8]}:", "timeout_s": 0.1},
            "renew_interval_s": 0.1, "lease_s": 0.5}})
        stack = start_stack("layered", tmp, config)
        try:
            yield stack, redis_server
        finally:
            stack.stop()


def families(address: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as answer:
        return {f.name: f for f in text_string_to_metric_families(answer.read().decode())}


def value(found: dict[str, Any], name: str, **labels: str) -> float:
    return float(next(s.value for s in found[name].samples
                      if s.labels == labels and not s.name.endswith("_created")))


def test_the_layered_rate_limiter_serves_its_store_families_on_its_own_metrics(
        layered: tuple[RunningStack, LocalRedis]) -> None:
    stack, _ = layered
    assert stack.placements["ratelimit"] == "remote" and stack.run_dir is not None
    with GatewayClient(stack.address, token=DEV_KEY) as client:
        result = client.generate(generation_pb2.GenerateRequest(model="default", prompt="hi", max_tokens=1),
                                 timeout=10.0)
    assert result.ok, result.details
    limiter = (stack.run_dir / ADDRESS_FILE).read_text().strip()
    def leased() -> Any:  # the request's buckets were made: the next renewal leases their tokens
        found = families(limiter)
        return found if value(found, "spine_ratelimit_store_leased_tokens", resource="requests") > 0 else None

    found = eventually(leased, 5.0, "the request's tokens leased from the store", interval=0.05)
    assert set(found) >= STORE_FAMILIES
    assert value(found, "spine_ratelimit_store_leasing") == 1.0
    assert value(found, "spine_ratelimit_store_replicas") == 1.0
    assert value(found, "spine_ratelimit_store_calls", result="ok") > 0
    assert value(found, "spine_ratelimit_store_leased_tokens", resource="requests") > 0
    assert value(found, "spine_ratelimit_store_leased_tokens", resource="tokens") > 0


def test_the_layered_stacks_metrics_show_the_limiters_store_families(layered: tuple[RunningStack, LocalRedis]) -> None:
    """The address `spine up` prints (the metrics component's process) has them too, forwarded
    from the limiter's process: one scrape shows everything, as in the collapsed spine."""
    stack, _ = layered
    address = stack.metrics_address()
    assert address is not None
    found = families(address)
    assert set(found) >= STORE_FAMILIES
    assert value(found, "spine_ratelimit_store_leasing") == 1.0


def test_without_a_store_the_layered_rate_limiter_serves_no_metrics_of_its_own(tmp_path: Path) -> None:
    from runtime.observability.store_metrics import serve_store_metrics

    class NoStore:
        store_collector = None

    assert serve_store_metrics(NoStore(), config_for_tests(), tmp_path) is None
    assert not (tmp_path / ADDRESS_FILE).exists()


def test_the_layered_limiters_fallback_and_recovery_are_counted_on_its_metrics(
        layered: tuple[RunningStack, LocalRedis]) -> None:
    stack, redis_server = layered
    assert stack.run_dir is not None
    limiter = (stack.run_dir / ADDRESS_FILE).read_text().strip()

    def wait_for(name: str, expected: float) -> dict[str, Any]:
        return eventually(lambda: (found := families(limiter)) and value(found, name) == expected and found,
                          5.0, f"{name} == {expected}", interval=0.05)

    redis_server.stop()
    try:
        found = wait_for("spine_ratelimit_store_leasing", 0.0)
        assert value(found, "spine_ratelimit_store_fallbacks") == 1.0
        with GatewayClient(stack.address, token=DEV_KEY) as client:  # still answering, on its share
            result = client.generate(generation_pb2.GenerateRequest(model="default", prompt="hi", max_tokens=1),
                                     timeout=10.0)
        assert result.ok, result.details
    finally:
        redis_server.start()  # same port, empty
    found = wait_for("spine_ratelimit_store_leasing", 1.0)
    assert value(found, "spine_ratelimit_store_recoveries") == 1.0
    assert value(found, "spine_ratelimit_store_restarts") == 1.0
