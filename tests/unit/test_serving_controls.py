"""Serving controls of the Inference servicer: priorities, compute budgets, the KV pool, load hints.

The servicer is the same class in both layouts; these tests call it in-process with the
in-process `LocalContext`, and the layout tests (test_serving_determinism) put it behind a
real gRPC server too. Decode steps are gated where a test needs "the pool is full" or "both
are in the batch" to be a fact rather than a race.
"""

from __future__ import annotations

import math

import grpc
import pytest

from services.common import ConfigError
from services.inference.load_hints import LOAD_HEADER, parse_load
from services.pipeline.local_context import LocalRpcError
from tests.unit.test_serving_support import (
    Call,
    admission_order,
    generate,
    make_service,
    request,
)
from tests.waiting import ManualClock, eventually

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def test_latency_class_is_admitted_before_a_throughput_job_that_queued_first() -> None:
    # A clock the test holds still: on a loaded host the real one could age the throughput job
    # past the aging bound before the latency job arrives (the next test's case, not this one's).
    service, model = make_service(clock=ManualClock(), kv_cache_max_entries=1, max_batch=1)
    try:
        model.hold()
        first = Call(service, request("first", 3))
        eventually(lambda: service.engine.active_count == 1, what="first job admitted")
        bulk = Call(service, request("throughput", 3, priority=-1))
        eventually(lambda: service.scheduler.queue_depth == 1)
        urgent = Call(service, request("latency", 3, priority=1))
        eventually(lambda: service.scheduler.queue_depth == 2)
        model.open()
        for call in (first, bulk, urgent):
            call.wait()
        assert admission_order(service) == ["first", "latency", "throughput"]
    finally:
        service.close()


def test_a_throughput_job_waiting_past_twice_the_aging_bound_goes_before_newer_latency_jobs() -> None:
    clock = ManualClock()
    service, model = make_service(clock=clock, kv_cache_max_entries=1, max_batch=1, aging_ms=100)
    try:
        model.hold()
        first = Call(service, request("first", 3))
        eventually(lambda: service.engine.active_count == 1)
        bulk = Call(service, request("throughput", 3, priority=-1))
        eventually(lambda: service.scheduler.queue_depth == 1)
        clock.advance(0.2)  # 2 × aging_ms: the throughput job now ranks with the latency class
        urgent = Call(service, request("latency", 3, priority=1))
        eventually(lambda: service.scheduler.queue_depth == 2)
        model.open()
        for call in (first, bulk, urgent):
            call.wait()
        assert admission_order(service) == ["first", "throughput", "latency"]
    finally:
        service.close()


def test_a_generation_past_its_compute_budget_stops_frees_its_slot_and_spares_its_batch_mate() -> None:
    clock = ManualClock()
    service, model = make_service(clock=clock, kv_cache_max_entries=2, max_batch=2)
    try:
        mate_alone = generate(service, request("batch mate", 12))[0].token_ids
        model.hold()
        slow = Call(service, request("long answer", 200, inference_timeout_ms=1000))
        eventually(lambda: service.engine.active_count == 1)
        mate = Call(service, request("batch mate", 12))
        # Queued behind the held step, or admitted at once if the scheduler was between steps.
        eventually(lambda: service.scheduler.queue_depth == 1 or service.engine.active_count == 2)
        model.release(1)  # the first step runs; the mate joins the batch before the next
        eventually(lambda: service.engine.active_count == 2, what="both in the batch")
        clock.advance(2.0)  # past the slow one's 1000 ms budget, well within the mate's default
        model.open()
        slow.wait()
        mate.wait()
        assert slow.error is not None and slow.error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "1000 ms" in slow.error.details()
        assert mate.tokens == list(mate_alone)
        eventually(lambda: service.engine.free_slots == 2, what="both slots free")
    finally:
        service.close()


def test_a_full_kv_pool_queues_up_to_max_queue_then_refuses_naming_the_limit() -> None:
    service, model = make_service(kv_cache_max_entries=1, max_batch=1, max_queue=1)
    try:
        model.hold()
        running = Call(service, request(max_tokens=4))
        eventually(lambda: service.engine.active_count == 1)
        queued = Call(service, request(max_tokens=4))
        eventually(lambda: service.scheduler.queue_depth == 1)
        with pytest.raises(LocalRpcError) as refused:
            generate(service, request(max_tokens=4))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_queue = 1" in refused.value.details() and "1 KV cache slots" in refused.value.details()
        trailing = dict(refused.value.trailing_metadata())
        load = parse_load(trailing[LOAD_HEADER])
        assert load["queue"] == 1 and load["kv_free"] == 0
        assert float(trailing["retry-after"]) > 0  # when the running sequence should be done
        model.open()
        assert running.wait().response is not None and queued.wait().response is not None
    finally:
        service.close()


def test_every_answer_carries_load_hints() -> None:
    service, _ = make_service(kv_cache_max_entries=3, max_batch=3)
    try:
        _, context = generate(service, request(max_tokens=2))
        load = parse_load(dict(context.trailing_metadata())[LOAD_HEADER])
        assert load["slots"] == 3 and load["kv_free"] == 3 and load["queue"] == 0 and load["running"] == 0
        assert load["mem_free_mb"] > 0 and load["ms_per_token"] == pytest.approx(service.ms_per_token, abs=1e-3)
        with pytest.raises(LocalRpcError) as refused:
            generate(service, request(priority=5))
        assert LOAD_HEADER in dict(refused.value.trailing_metadata())
    finally:
        service.close()


@pytest.mark.parametrize(("fields", "needle"), [
    ({"priority": 2}, "priority: must be -1 (throughput), 0 (default) or 1"),
    ({"priority": -2}, "got -2"),
    ({"inference_timeout_ms": 60_001}, "above the cap of 60000 ms (inference.max_timeout_ms)"),
    ({"inference_timeout_ms": -5}, "inference_timeout_ms: must be >= 0"),
])
def test_bad_serving_fields_are_refused_naming_field_and_limit(fields: dict[str, int], needle: str) -> None:
    service, _ = make_service(max_timeout_ms=60_000)
    try:
        with pytest.raises(LocalRpcError) as refused:
            generate(service, request(**fields))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in refused.value.details()
    finally:
        service.close()


def test_a_timeout_of_zero_means_the_default_budget_from_measured_ms_per_token() -> None:
    service, _ = make_service(timeout_margin_ms=700, timeout_slowdown=3, max_timeout_ms=90_000)
    try:
        ms = service.cost.ms_per_token(1)
        assert ms > 0
        assert service.default_timeout_ms(10, batch=1) == math.ceil(10 * ms * 3 + 700)
        assert service.default_timeout_ms(10**9) == 90_000  # capped
        response, _ = generate(service, request(max_tokens=4, inference_timeout_ms=0))
        assert response.completion_tokens == 4
    finally:
        service.close()


def test_asking_for_more_kv_slots_than_max_batch_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="inference.kv_cache_max_entries: 9 slots is more than max_batch"):
        make_service(kv_cache_max_entries=9, max_batch=8)


def test_a_failing_model_step_fails_the_batch_with_internal_and_the_service_keeps_serving() -> None:
    service, model = make_service()
    try:
        model.broken = True
        with pytest.raises(LocalRpcError) as failed:
            generate(service, request())
        assert failed.value.code() == grpc.StatusCode.INTERNAL and "device lost" in failed.value.details()
        model.broken = False
        assert generate(service, request(max_tokens=3))[0].completion_tokens == 3
        assert service.engine.free_slots == service.engine.max_slots
    finally:
        service.close()
