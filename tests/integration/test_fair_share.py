"""Fair sharing between tenants at one priority: a queue per tenant, weighted round robin,
a full queue shared by weight; priority classes still order across tenants.

Every assertion counts admissions (or places in the queue), never times: the scheduler's
admission order is a fact once the model is held, and the queue's order is pure.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from runtime.bare import ClientContext
from services.common import ConfigError
from services.common.tenant_shares import TenantShares, tenant_metadata
from services.component import ComponentConfig
from services.component_factories import tenant_shares
from services.inference.priority import AgingPriorityQueue
from services.pipeline.local_context import LocalContext
from services.ratelimit.config import RateLimitConfig
from spine.client.gateway_client import GatewayClient
from tests.conftest import DEV_KEY, OTHER_KEY, served, start_stack
from tests.unit.test_serving_support import Call, make_service, request
from tests.waiting import ManualClock, eventually
from wire.v1 import generation_pb2

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _queue(*tenants: tuple[str, int, float], priority: int = 0) -> AgingPriorityQueue[str]:
    """A queue holding `count` items of each (tenant, count, weight), pushed in that order."""
    waiting: AgingPriorityQueue[str] = AgingPriorityQueue(aging_ms=10_000)
    for tenant, count, weight in tenants:
        for i in range(count):
            waiting.push(f"{tenant}{i}", priority, now=0.0, tenant=tenant, weight=weight)
    return waiting


def _pops(waiting: AgingPriorityQueue[str], n: int, now: float = 0.0) -> list[str]:
    return [item for item in (waiting.pop(now) for _ in range(n)) if item is not None]


def test_a_tenant_flooding_the_queue_does_not_hold_back_another_at_the_same_priority() -> None:
    waiting = _queue(("a", 200, 1.0), ("b", 10, 1.0))  # b's requests arrive behind a's 200
    first = _pops(waiting, 20)
    assert sum(item.startswith("b") for item in first) == 10  # one turn in two: all of b's are in
    # Without tenants the same arrivals are one FIFO: b would wait for all 200 of a's.
    fifo: AgingPriorityQueue[str] = AgingPriorityQueue(aging_ms=10_000)
    for item in [f"a{i}" for i in range(200)] + [f"b{i}" for i in range(10)]:
        fifo.push(item, 0, now=0.0)
    assert not any(item.startswith("b") for item in _pops(fifo, 200))
    # Each tenant's own requests keep their arrival order.
    assert [item for item in first if item.startswith("b")] == [f"b{i}" for i in range(10)]


def test_admissions_follow_the_tiers_weights_while_both_tenants_wait() -> None:
    waiting = _queue(("free", 100, 1.0), ("pro", 100, 3.0))
    first = _pops(waiting, 40)
    pro = sum(item.startswith("pro") for item in first)
    assert abs(pro - 30) <= 1 and abs((40 - pro) - 10) <= 1  # 3 : 1, within one turn


def test_a_tenant_that_was_away_cannot_bank_turns_nor_lose_them() -> None:
    waiting = _queue(("a", 100, 1.0))
    assert len(_pops(waiting, 50)) == 50  # a alone for 50 admissions
    for i in range(10):
        waiting.push(f"b{i}", 0, now=0.0, tenant="b")
    turns = ["b" if item.startswith("b") else "a" for item in _pops(waiting, 9)]
    assert turns[0] == "b"  # its next turn is the next admission: not behind a's backlog...
    assert turns.count("b") == 5  # ...and one in two from then on, not the 50 turns it missed


def test_priority_classes_still_order_across_tenants_and_aging_still_promotes() -> None:
    waiting: AgingPriorityQueue[str] = AgingPriorityQueue(aging_ms=500)
    for i in range(5):
        waiting.push(f"b-default{i}", 0, now=0.0, tenant="b")
        waiting.push(f"a-latency{i}", 1, now=0.0, tenant="a")
    assert _pops(waiting, 5, now=0.1) == [f"a-latency{i}" for i in range(5)]
    waiting.push("a-throughput", -1, now=0.1, tenant="a")
    for i in range(5, 9):
        waiting.push(f"a-latency{i}", 1, now=1.2, tenant="a")
    # the default jobs have waited past aging_ms (due): they take every other admission
    order = _pops(waiting, 6, now=1.2)
    assert order[:2] == ["b-default0", "a-latency5"] or order[:2] == ["a-latency5", "b-default0"]
    assert sum(item.startswith("b-default") for item in order) == 3


def test_a_full_queue_makes_room_by_displacing_the_newest_of_the_tenant_over_its_share() -> None:
    waiting = _queue(("a", 8, 1.0))
    assert waiting.evict_for(0, "b") == "a7"  # b holds none: a's newest makes room
    assert waiting.evict_for(0, "a") is None  # a itself: nobody holds more than a would
    assert waiting.evict_for(1, "b") is None  # another class's queue is not shared with this one
    weighted = _queue(("a", 2, 1.0), ("pro", 4, 4.0))
    assert weighted.evict_for(0, "a") is None  # pro holds 4 / 4 = 1 per unit, a would hold 3
    assert weighted.evict_for(0, "b") == "a1"  # a holds 2 per unit, more than b's 1 after joining


def test_the_scheduler_admits_the_other_tenant_at_its_next_turn_and_shares_a_full_queue() -> None:
    service, model = make_service(kv_cache_max_entries=1, max_batch=1, max_queue=6)
    try:
        model.hold()
        first = Call(service, request("first", 2), [tenant_metadata("a")])
        eventually(lambda: service.engine.active_count == 1, what="first admitted")
        flood = []
        for i in range(6):
            flood.append(Call(service, request(f"a{i}", 2), [tenant_metadata("a")]))
            eventually(lambda n=i + 1: service.scheduler.queue_depth == n)
        others = [Call(service, request(f"b{i}", 2), [tenant_metadata("b")]) for i in range(2)]
        eventually(lambda: service.scheduler.queue_depth == 6, what="b's two took a's two newest places")
        model.open()
        for call in (first, *flood, *others):
            call.wait()
        displaced = [call for call in flood if call.error is not None]
        assert len(displaced) == 2 and all(c.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for c in displaced)
        assert "more than its share" in displaced[0].error.details()
        assert float(dict(displaced[0].error.trailing_metadata())["retry-after"]) > 0
        tenants = [job.tenant for job in service.scheduler.recent_admissions][-7:]
        assert tenants[0] == "a" and tenants[1:5].count("b") == 2  # b's two within its next two turns
    finally:
        service.close()


@pytest.mark.parametrize("headroom", [1, 0])
def test_the_last_free_slot_goes_to_a_tenant_below_its_share_not_to_the_flooder(headroom: int) -> None:
    clock = ManualClock()
    service, model = make_service(clock=clock, kv_cache_max_entries=4, max_batch=4, share_headroom_slots=headroom)
    try:
        scheduler = service.scheduler
        assert Call(service, request("b was here", 1), [tenant_metadata("b")]).wait().response is not None
        model.hold()
        flood = [Call(service, request("a0", 40), [tenant_metadata("a")])]
        eventually(lambda: service.engine.active_count == 1)
        flood += [Call(service, request(f"a{i}", 40), [tenant_metadata("a")]) for i in range(1, 6)]
        eventually(lambda: scheduler.queue_depth == 5)
        model.release(1)  # a step ends: a takes free slots, but not the last one while b is active
        eventually(lambda: service.engine.active_count == 4 - headroom, what="a admitted to all but the headroom")
        other = Call(service, request("b1", 2), [tenant_metadata("b")])
        eventually(lambda: scheduler.queue_depth == 6 - (4 - headroom) + 1)
        model.release(1)  # the next step ends, no sequence has finished
        if headroom:
            eventually(lambda: service.engine.active_count == 4, what="b admitted into the headroom slot")
            assert scheduler.recent_admissions[-1].tenant == "b"
        else:
            eventually(lambda: model.steps >= 3)  # the step ran; nothing could be admitted
            assert scheduler.recent_admissions[-1].tenant == "a" and service.engine.active_count == 4
        model.open()
        for call in (*flood, other):
            assert call.wait().response is not None
        # Alone (b quiet for longer than a second), a takes every slot: the headroom costs nothing.
        clock.advance(2.0)
        model.hold()
        alone = [Call(service, request(f"alone{i}", 40), [tenant_metadata("a")]) for i in range(5)]
        eventually(lambda: service.engine.active_count >= 1 and scheduler.queue_depth + service.engine.active_count == 5)
        model.release(1)
        eventually(lambda: service.engine.active_count == 4, what="a alone in every slot")
        model.open()
        for call in alone:
            call.wait()
    finally:
        service.close()


def test_share_weights_come_from_the_ratelimit_tiers_and_bad_ones_name_the_field() -> None:
    config = ComponentConfig.parse({"ratelimit": {"default": {"share_weight": 2},
                                                  "tenants": {"pro": {"share_weight": 8}, "free": {}}}})
    shares = tenant_shares(config.ratelimit)
    assert (shares.weight("pro"), shares.weight("free"), shares.weight("anyone")) == (8.0, 2.0, 2.0)
    assert TenantShares().weight("x") == 1.0
    assert config.ratelimit.limits_for("free").share_weight == 2.0
    with pytest.raises(ConfigError, match=r"ratelimit\.tenants\.pro\.share_weight"):
        ComponentConfig.parse({"ratelimit": {"tenants": {"pro": {"share_weight": 0}}}})
    with pytest.raises(ConfigError, match=r"ratelimit\.tenants\.pro\.share_weight"):
        RateLimitConfig.parse({"tenants": {"pro": {"share_weight": -1}}})


def test_the_tenant_reaches_the_model_through_the_gateway_and_over_grpc_but_never_from_a_client(
        tmp_path: Path) -> None:
    stack = start_stack("collapsed", tmp_path)
    try:
        scheduler = stack.local_servicers["inference"].first.scheduler
        for key, tenant in ((DEV_KEY, "dev"), (OTHER_KEY, "other")):
            with GatewayClient(stack.address, key) as client:
                assert client.generate(request(f"whose {tenant}", 2)).ok
            assert scheduler.recent_admissions[-1].tenant == tenant
    finally:
        stack.stop()
    service, _ = make_service()
    try:
        with served("inference", service) as stub:  # the layered layout's hop: gRPC metadata
            # A tenant is whatever the token's issuer wrote: any Unicode, control characters too.
            remote = "remote-テナント\x07\ud800"
            stub.Generate(request("over grpc", 2), metadata=(tenant_metadata(remote),), timeout=30)
        assert service.scheduler.recent_admissions[-1].tenant == remote
        claimed = ClientContext(LocalContext((tenant_metadata("pro"), ("x-request-id", "r1"))))
        assert service.Generate(generation_pb2.GenerateRequest(model="tiny-lm", prompt="bare", max_tokens=2), claimed)
        assert service.scheduler.recent_admissions[-1].tenant == ""  # a bare server's client claims nothing
    finally:
        service.close()
