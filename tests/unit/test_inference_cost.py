"""The compute budget tracks what tokens cost now: an EWMA of ms per step per batch size.

Before, the default budget came from a warm-up at start; on a busy host valid requests died
of it at 254 of 256 tokens. Here a model that becomes 20× slower after start still answers
every request, and the load hint reports the slower cost.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from services.inference.cost import BudgetRule, StepCost
from services.inference.load_hints import LOAD_HEADER, parse_load
from tests.paced_backend import SlowedModel
from tests.unit.test_serving_support import generate, make_service, request

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def test_the_cost_of_a_batch_size_follows_its_recent_steps() -> None:
    cost = StepCost(max_batch=4, seed_ms=1.0, alpha=0.5)
    assert cost.ms_per_token(1) == 1.0
    for _ in range(20):
        cost.observe(1, 0.010)
    assert cost.ms_per_token(1) == pytest.approx(10.0, rel=1e-3)
    cost.observe(1, 0.002)
    assert cost.ms_per_token(1) == pytest.approx(6.0, rel=1e-3)  # half way: alpha 0.5


def test_a_batch_size_not_seen_yet_borrows_from_the_next_larger_then_the_next_smaller() -> None:
    cost = StepCost(max_batch=8, seed_ms=1.0, alpha=1.0)
    cost.observe(4, 0.004)
    assert cost.ms_per_token(2) == 4.0  # the larger one: an over-estimate is the safe side
    assert cost.ms_per_token(6) == 4.0  # nothing larger: the next smaller
    assert cost.ms_per_token(100) == 4.0  # past max_batch counts as max_batch
    assert cost.measured() == {1: 1.0, 4: 4.0}


def test_the_default_budget_rule_is_tokens_times_cost_times_slowdown_plus_margin_capped() -> None:
    rule = BudgetRule(slowdown=3.0, margin_ms=700.0, cap_ms=90_000)
    assert rule.default_ms(10, 2.0) == 10 * 2 * 3 + 700
    assert rule.default_ms(10**9, 2.0) == 90_000


def test_valid_requests_finish_when_the_host_turns_20_times_slower_after_start() -> None:
    model = SlowedModel()
    service, _ = make_service(model, timeout_margin_ms=0, timeout_slowdown=2, max_batch=4, kv_cache_max_entries=4)
    try:
        warm_ms = service.ms_per_token
        model.slow_s = max(0.02, 20 * warm_ms / 1000.0)
        # Budgeted from the warm-up, 30 tokens at 20× the cost would need 10× the budget.
        results: list[Any] = []
        callers = [threading.Thread(target=lambda i=i: results.append(generate(service, request(f"slow {i}", 30))))
                   for i in range(4)]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join(60)
        assert len(results) == 4 and all(response.completion_tokens > 0 for response, _ in results)
        _, context = generate(service, request("after", 10))
        reported = parse_load(dict(context.trailing_metadata())[LOAD_HEADER])["ms_per_token"]
        print(f"\nwarm-up {warm_ms:.2f} ms/token; measured after the slowdown {reported:.2f} ms/token")
        assert reported >= 10 * warm_ms
    finally:
        model.slow_s = 0.0
        service.close()


def test_a_running_jobs_default_budget_rises_with_the_cost_and_never_falls() -> None:
    model = SlowedModel()
    service, _ = make_service(model, timeout_margin_ms=0, timeout_slowdown=2)
    try:
        model.slow_steps = 20  # a burst of load, then a quiet host again
        response, _ = generate(service, request("a burst of load", 40))
        job = service.scheduler.recent_admissions[-1]
        assert response.completion_tokens == 40
        # The burst raised the budget to ~40 × 10 ms × 2; the quiet steps after it did not lower it.
        assert job.budget_ms >= 600
        assert service.default_timeout_ms(40, batch=1) < job.budget_ms / 4
    finally:
        service.close()
