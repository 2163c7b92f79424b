"""A plan with a judge driving the controller: its sqlite store, and the HTTP front's own
per-request records as the judge's samples (the front is not serving: the outcomes it
would have recorded are added to its log, at the controller's clock)."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from migration.controller import Controller
from migration.legacy_endpoint import LegacyEndpoint
from migration.plan import load_plan
from migration.status import State
from migration.testing import FakeClock
from migration.traffic.http_front import HttpFront
from migration.traffic.legacy_target import LegacyTarget
from migration.traffic.outcomes import Outcome

LEGACY = "http://127.0.0.1:9"  # never dialled
# Latency weighs 20, errors 80: a slower spine alone scores 80, between pass 90 and marginal 75.
PLAN = textwrap.dedent(f"""\
    name: judged
    legacy: {{http: {LEGACY}}}
    window_s: 1
    min_window_requests: 5
    judge:
      groups:
        - {{name: latency, weight: 20, metrics: [{{name: latency, kind: latency}}]}}
        - {{name: errors, weight: 80, metrics: [{{name: error_rate, kind: error_rate, critical: true}}]}}
    stages:
      - {{name: canary, spine_weight: 10, hold_s: 1}}
      - {{name: all, spine_weight: 100, hold_s: 1}}
    """)


@pytest.fixture
def rollout(tmp_path: Path) -> Iterator[tuple[Controller, HttpFront, FakeClock]]:
    front = HttpFront(LegacyEndpoint(LEGACY, "authorization"), "http://127.0.0.1:9")
    clock = FakeClock()
    controller = Controller.open(str(tmp_path / "state.db"), LegacyTarget(front), clock=clock)
    controller.start(load_plan(PLAN), "tester")
    controller.tick(clock.now)  # the front takes the weight at once: the first window opens
    yield controller, front, clock
    controller.close()


def traffic(front: HttpFront, clock: FakeClock, rng: np.random.Generator, *, spine_ms: float, count: int = 300,
            spine_errors: int = 0) -> None:
    """`count` requests a side ending now: layered around 20 ms, spine around `spine_ms`."""
    for side, median in (("layered", 20.0), ("spine", spine_ms)):
        for latency in rng.lognormal(np.log(median), 0.3, count):
            front.log.add(Outcome(clock.now, side, False, float(latency), ok=True))
    for _ in range(spine_errors):
        front.log.add(Outcome(clock.now, "spine", True, 5.0))


def window(controller: Controller, clock: FakeClock) -> None:
    controller.tick(clock.advance(1.1))


def test_a_marginal_score_holds_the_stage_for_another_window_then_a_pass_advances(
        rollout: tuple[Controller, HttpFront, FakeClock]) -> None:
    controller, front, clock = rollout
    rng = np.random.default_rng(11)
    clock.advance(0.5)
    traffic(front, clock, rng, spine_ms=26.0)
    window(controller, clock)
    status = controller.status
    assert (status.state, status.stage_index, status.last_verdict) == (State.PROGRESSING, 0, "inconclusive")
    rows = {r.gate: r for r in controller.store.gate_history(10)}
    assert rows["judge"].value == 80.0 and rows["judge"].message.startswith("marginal: score 80.0")
    latency = rows["judge.latency"]
    assert latency.verdict == "fail" and latency.value is not None and latency.value > 0  # the shift, in ms
    assert "98% CI [" in latency.message and rows["judge.error_rate"].verdict == "pass"

    clock.advance(0.5)
    traffic(front, clock, rng, spine_ms=20.0)
    window(controller, clock)
    assert controller.status.stage_index == 1  # held 1 s and a passing window: on to the next stage
    advance = controller.store.recent_audit(1)[0]
    assert advance.action == "advance" and advance.reason.endswith("gates passing, judge score 100.0")


def test_too_few_samples_cannot_tell_and_the_stage_holds(rollout: tuple[Controller, HttpFront, FakeClock]) -> None:
    controller, front, clock = rollout
    rng = np.random.default_rng(12)
    for _ in range(3):
        clock.advance(0.5)
        traffic(front, clock, rng, spine_ms=20.0, count=20)  # enough for the gates' 5, not the judge's 50
        window(controller, clock)
    assert (controller.status.stage_index, controller.status.last_verdict) == (0, "inconclusive")
    judge = next(r for r in reversed(controller.store.gate_history(10)) if r.gate == "judge")
    assert judge.verdict == "inconclusive" and judge.message.startswith("cannot tell")


def test_a_failing_critical_metric_rolls_back_with_the_score_in_the_audit_trail(
        rollout: tuple[Controller, HttpFront, FakeClock]) -> None:
    controller, front, clock = rollout
    rng = np.random.default_rng(13)
    clock.advance(0.5)
    traffic(front, clock, rng, spine_ms=20.0, spine_errors=30)
    window(controller, clock)
    assert controller.status.state in (State.ROLLING_BACK, State.ROLLED_BACK)
    rollback = next(entry for entry in controller.store.recent_audit(5) if entry.action == "rollback")
    assert "judge: score 0: critical metric error_rate failed" in rollback.reason
    assert "Fisher p=" in rollback.reason and "odds ratio" in rollback.reason
