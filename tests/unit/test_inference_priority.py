"""Admission order by priority class with aging, the KV pool's sizing formula, and config errors."""

from __future__ import annotations

import pytest

from services.common import ConfigError
from services.inference.config import InferenceConfig
from services.inference.model.kv_budget import plan_kv_slots
from services.inference.priority import AgingPriorityQueue, effective_class, priority_error

MIB = 1 << 20


def test_higher_classes_are_admitted_first_and_arrival_order_is_kept_within_a_class() -> None:
    waiting: AgingPriorityQueue[str] = AgingPriorityQueue(aging_ms=500)
    for name, priority in [("t1", -1), ("d1", 0), ("l1", 1), ("t2", -1), ("l2", 1)]:
        waiting.push(name, priority, now=0.0)
    assert [waiting.pop(now=0.1) for _ in range(5)] == ["l1", "l2", "d1", "t1", "t2"]
    assert waiting.pop(now=0.1) is None


def test_a_waiting_job_is_promoted_one_class_per_aging_period() -> None:
    assert effective_class(-1, waited_ms=499, aging_ms=500) == -1
    assert effective_class(-1, waited_ms=500, aging_ms=500) == 0
    assert effective_class(-1, waited_ms=1000, aging_ms=500) == 1
    assert effective_class(0, waited_ms=10_000, aging_ms=500) == 1  # never above the top class


def test_the_throughput_class_never_starves_under_a_stream_of_latency_jobs() -> None:
    waiting: AgingPriorityQueue[str] = AgingPriorityQueue(aging_ms=500)
    waiting.push("throughput", -1, now=0.0)
    admitted = []
    for tick in range(10):  # a new latency job arrives every 250 ms and one job is admitted
        now = tick * 0.25
        waiting.push(f"latency{tick}", 1, now=now)
        admitted.append(waiting.pop(now=now))
    assert "throughput" in admitted
    # promoted to the top class after 2 × aging_ms = 1 s, then it is the oldest there
    assert admitted.index("throughput") == 4


def test_a_latency_request_waits_for_at_most_one_due_job_however_many_are_due() -> None:
    waiting: AgingPriorityQueue[str] = AgingPriorityQueue(aging_ms=500)
    for i in range(200):
        waiting.push(f"t{i}", -1, now=0.0)
    waiting.push("latency", 1, now=5.0)  # every throughput job has waited 10 × aging_ms: all due
    first_two = [waiting.pop(now=5.0), waiting.pop(now=5.0)]
    assert "latency" in first_two
    # ...and the due keep every other admission while latency requests keep coming
    for tick in range(6):
        waiting.push(f"latency{tick}", 1, now=5.0)
        pair = {waiting.pop(now=5.0), waiting.pop(now=5.0)}
        assert pair == {f"latency{tick}", f"t{tick + 1}"}  # one each, the due in arrival order


def test_priority_outside_the_three_classes_is_refused_with_the_allowed_values() -> None:
    assert priority_error(1) is None and priority_error(-1) is None
    problem = priority_error(2)
    assert problem is not None and "-1 (throughput)" in problem and "got 2" in problem
    with pytest.raises(ValueError, match="got 7"):
        AgingPriorityQueue[str](500).push("x", 7, now=0.0)


def test_the_kv_pool_is_sized_by_the_documented_formula() -> None:
    plan = plan_kv_slots(per_slot_bytes=2 * MIB, weight_bytes=10 * MIB, free_bytes=100 * MIB,
                         memory_fraction=0.5, max_batch=64)
    assert plan.slots == plan.memory_bound == (50 - 10) // 2 == 20
    assert "20 slots" in plan.describe() and "100.0 MiB free" in plan.describe()
    capped = plan_kv_slots(per_slot_bytes=2 * MIB, weight_bytes=10 * MIB, free_bytes=100 * MIB,
                           memory_fraction=0.5, max_batch=8)
    assert capped.slots == 8 and capped.memory_bound == 20


def test_asking_for_more_slots_than_memory_allows_names_the_bound() -> None:
    with pytest.raises(ValueError, match="memory allows 20"):
        plan_kv_slots(per_slot_bytes=2 * MIB, weight_bytes=10 * MIB, free_bytes=100 * MIB,
                      memory_fraction=0.5, max_batch=64, requested=21)
    with pytest.raises(ValueError, match="not enough memory for one KV cache slot"):
        plan_kv_slots(per_slot_bytes=2 * MIB, weight_bytes=10 * MIB, free_bytes=10 * MIB,
                      memory_fraction=0.5, max_batch=64)


@pytest.mark.parametrize(("cfg", "field"), [
    ({"kv_cache_max_entries": 0}, "inference.kv_cache_max_entries"),
    ({"kv_cache_max_entries": "lots"}, "inference.kv_cache_max_entries"),
    ({"kv_memory_fraction": 1.5}, "inference.kv_memory_fraction"),
    ({"max_timeout_ms": 0}, "inference.max_timeout_ms"),
    ({"aging_ms": -1}, "inference.aging_ms"),
    ({"stream_buffer_chunks": 2.5}, "inference.stream_buffer_chunks"),
    ({"deterministic": "yes"}, "inference.deterministic"),
    ({"priority_classes": 3}, "unknown key"),
])
def test_bad_inference_config_is_refused_naming_the_field(cfg: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        InferenceConfig.parse(cfg)
