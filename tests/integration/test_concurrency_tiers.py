"""Concurrency tiers through the Gateway, in both layouts and across a traffic split.

The model is paced (every decode step takes 25 ms), so a request of 80 tokens runs for about
two seconds: six sent at once are in flight together, and the tenant's limit decides.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from migration.limit_shares import side_shares
from runtime.running_stack import RunningStack
from services.pipeline.interface import CallOptions
from services.ratelimit.api import RATELIMIT
from spine.client.gateway_client import CallResult, GatewayClient
from tests.conftest import TEST_OVERRIDES, config_for_tests, start_stack
from tests.waiting import eventually
from wire.v1 import gateway_pb2_grpc, generation_pb2

TIER_KEYS = {"tier2": "tier2-tenant-key-0000", "tier4": "tier4-tenant-key-0000"}
STEP_MS = 25
LONG = 80  # tokens: ~2 s


def tiers_config(**extra: Any) -> dict[str, Any]:
    keys = [*TEST_OVERRIDES["auth"]["api_keys"],
            *({"id": f"{t}-key", "tenant": t, "key": key, "scopes": ["generate"]} for t, key in TIER_KEYS.items())]
    return config_for_tests(
        auth={"api_keys": keys},
        ratelimit={"tenants": {**TEST_OVERRIDES["ratelimit"]["tenants"], "tier2": {"max_concurrent_requests": 2},
                               "tier4": {"max_concurrent_requests": 4}}, **extra.pop("ratelimit", {})},
        inference={"backend": {"class": "tests.paced_backend:paced", "options": {"step_ms": STEP_MS}},
                   "warmup_tokens": 2},
        **extra)


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RunningStack]]:
    tmp = tmp_path_factory.mktemp("tiers")
    started: dict[str, RunningStack] = {}
    try:
        for layout in ("collapsed", "layered"):
            started[layout] = start_stack(layout, tmp, tiers_config())
        yield started
    finally:
        for stack in started.values():
            stack.stop()


def long_request(tag: str, max_tokens: int = LONG) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(model="tiny-lm", prompt=f"a long answer please, {tag}", max_tokens=max_tokens)


def at_once(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run the calls in threads released together; their results in order."""
    results: list[Any] = [None] * len(calls)
    start = threading.Barrier(len(calls))

    def run(i: int) -> None:
        start.wait()
        results[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


def six_long(address: str, tenant: str, tag: str) -> list[CallResult]:
    with GatewayClient(address, TIER_KEYS[tenant]) as client:
        return at_once([lambda i=i: client.generate(long_request(f"{tag} {i}")) for i in range(6)])


def assert_refused_for_concurrency(result: CallResult, tenant: str) -> None:
    assert result.code == grpc.StatusCode.RESOURCE_EXHAUSTED, (result.code, result.details)
    assert f"tenant={tenant},resource=concurrent_requests" in result.details
    assert float(result.trailing["retry-after"]) > 0
    assert "x-spine-load" in result.trailing  # the model's load, though it was not called


def admitted_soon(address: str, tenant: str, tag: str, within_s: float) -> float:
    """Seconds until a short request of `tenant` is admitted (polling), or fail."""
    started = time.monotonic()
    attempts = itertools.count()
    with GatewayClient(address, TIER_KEYS[tenant]) as client:

        def admitted() -> bool:
            result = client.generate(long_request(f"{tag} poll {next(attempts)}", max_tokens=1))
            assert result.ok or result.code == grpc.StatusCode.RESOURCE_EXHAUSTED, result.details
            return bool(result.ok)

        eventually(admitted, within_s, f"a request of {tenant} admitted", interval=0.05)
    return time.monotonic() - started


def open_streams(address: str, tenant: str, tag: str, n: int, max_tokens: int) -> tuple[grpc.Channel, list[Any]]:
    """`n` streams whose first chunk has arrived (so each holds its slot now)."""
    channel = grpc.insecure_channel(address)
    stub = gateway_pb2_grpc.GatewayStub(channel)
    metadata = (("authorization", f"Bearer {TIER_KEYS[tenant]}"),)
    calls = [stub.GenerateStream(long_request(f"{tag} {i}", max_tokens), metadata=metadata, timeout=60) for i in range(n)]
    for call in calls:
        next(call)
    return channel, calls


@pytest.mark.parametrize("layout", ["collapsed", "layered"])
def test_six_concurrent_long_requests_with_a_limit_of_two_admit_two_and_refuse_four_with_retry_after(
        stacks: dict[str, RunningStack], layout: str) -> None:
    address = stacks[layout].address
    started = time.monotonic()
    results = six_long(address, "tier2", f"six {layout}")
    elapsed = time.monotonic() - started
    ok = [r for r in results if r.ok]
    refused = [r for r in results if not r.ok]
    print(f"\n{layout}: {len(ok)} answered, {len(refused)} refused "
          f"(retry-after {[r.trailing.get('retry-after') for r in refused]}), {elapsed:.2f}s")
    assert len(ok) == 2 and len(refused) == 4
    assert all(len(r.token_ids) == LONG for r in ok)
    for result in refused:
        assert_refused_for_concurrency(result, "tier2")
    # Both have finished: the tenant's next two run together again.
    again = at_once([lambda i=i: GatewayClient(address, TIER_KEYS["tier2"]).generate(long_request(f"again {layout} {i}", 4))
                     for i in range(2)])
    assert [r.code for r in again] == [grpc.StatusCode.OK] * 2


@pytest.mark.parametrize("layout", ["collapsed", "layered"])
def test_a_stream_holds_its_slot_until_its_last_chunk(stacks: dict[str, RunningStack], layout: str) -> None:
    address = stacks[layout].address
    channel, streams = open_streams(address, "tier2", f"hold {layout}", 2, LONG)
    try:
        with GatewayClient(address, TIER_KEYS["tier2"]) as client:
            assert_refused_for_concurrency(client.generate(long_request(f"third {layout}", 1)), "tier2")
            for stream in streams:
                chunks = 1 + sum(1 for _ in stream)
                assert chunks == LONG and stream.code() == grpc.StatusCode.OK
            assert client.generate(long_request(f"after {layout}", 1)).ok
    finally:
        channel.close()


@pytest.mark.parametrize("layout", ["collapsed", "layered"])
def test_a_cancelled_stream_releases_its_slot(stacks: dict[str, RunningStack], layout: str) -> None:
    address = stacks[layout].address
    channel, streams = open_streams(address, "tier2", f"cancel {layout}", 2, 200)  # ~5 s each
    try:
        streams[0].cancel()
        waited = admitted_soon(address, "tier2", f"cancel {layout}", within_s=3.0)
        print(f"\n{layout}: admitted {waited:.2f}s after the cancel (the stream had ~5 s to go)")
        streams[1].cancel()
    finally:
        channel.close()
    admitted_soon(address, "tier2", f"cancel {layout} end", within_s=3.0)


def test_across_a_split_each_side_enforces_its_share(stacks: dict[str, RunningStack]) -> None:
    """Half the traffic to each side, each with its own rate limiter: a tenant allowed 4 in
    flight gets 2 on each side, 4 in all; one allowed 2 gets 1 on each side (at least 1)."""
    spine_share, layered_share = side_shares(50, spine_limits_locally=True)
    sides = {"spine": stacks["collapsed"], "layered": stacks["layered"]}
    shares = {"spine": spine_share, "layered": layered_share}
    for side, stack in sides.items():
        stack.component(RATELIMIT).set_share(shares[side], CallOptions(timeout=5))
    try:
        for tenant, per_side in (("tier4", 2), ("tier2", 1)):
            both = at_once([functools.partial(six_long, stack.address, tenant, f"split {tenant} {side}")
                            for side, stack in sides.items()])
            answered = dict(zip(sides, both, strict=True))
            counts = {side: sum(r.ok for r in results) for side, results in answered.items()}
            print(f"\nsplit 50/50, {tenant}: admitted per side {counts}")
            assert counts == {"spine": per_side, "layered": per_side}
            for results in answered.values():
                for result in results:
                    if not result.ok:
                        assert_refused_for_concurrency(result, tenant)
    finally:
        for stack in sides.values():
            stack.component(RATELIMIT).set_share(1.0, CallOptions(timeout=5))


def test_the_limit_is_halved_while_the_model_keeps_the_device_busy(tmp_path: Path) -> None:
    """With `concurrency_when_busy.halve`, a tenant allowed 4 gets 2 while the decode loop is
    busy (another tenant's long requests), and 4 again once it has been idle."""
    stack = start_stack("collapsed", tmp_path, tiers_config(ratelimit={"concurrency_when_busy": {"halve": True}}))
    try:
        with GatewayClient(stack.address, TIER_KEYS["tier2"]) as busy_maker:
            background = threading.Thread(target=lambda: at_once(
                [lambda i=i: busy_maker.generate(long_request(f"busy {i}", 160)) for i in range(2)]))
            background.start()
            model = stack.local_servicers["inference"].first
            eventually(lambda: model.engine.active_count == 2, 30, "both long requests decoding")
            with GatewayClient(stack.address, TIER_KEYS["tier2"]) as probe:  # refused (tier2 is full), with the hint
                hint = eventually(lambda: (load := probe.generate(long_request("hint", 1)).load)["busy"] > 0.9
                                  and load, 30, "the loop stepping back to back for a while", interval=0.1)
            assert hint["busy"] > 0.9, hint
            busy = six_long(stack.address, "tier4", "while busy")
            background.join(30)
        assert sum(r.ok for r in busy) == 2
        # Idle: the busy fraction the limiter reads (the gateway's, from the model's hints) falls below 0.8.
        eventually(lambda: stack.gateway.model_load.busy() < 0.8, 30, "the device calm",
                   interval=0.05, seen=stack.gateway.model_load.busy)
        calm = six_long(stack.address, "tier4", "when calm")
        assert sum(r.ok for r in calm) == 4
    finally:
        stack.stop()
