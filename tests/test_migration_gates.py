"""Gate arithmetic: pass, fail, inconclusive and dry run, on one window of each side."""

from __future__ import annotations

import pytest

from migration.gates import (
    Verdict,
    WindowStats,
    error_rate_gate,
    evaluate,
    latency_p99_ratio_gate,
    parity_gate,
    window_verdict,
)
from migration.plan import GateSpec

LAYERED = WindowStats(requests=1000, errors=10, p99_ms=100.0)  # 1% errors


@pytest.mark.parametrize("spine_errors, verdict", [(20, Verdict.PASS), (21, Verdict.FAIL), (0, Verdict.PASS)])
def test_error_rate_passes_up_to_the_layered_rate_plus_max_delta(spine_errors, verdict):
    result = error_rate_gate(LAYERED, WindowStats(1000, spine_errors, 90.0), max_delta=0.01, min_requests=10)
    assert result.verdict is verdict
    assert result.value == pytest.approx(spine_errors / 1000 - 0.01)
    assert result.threshold == 0.01


@pytest.mark.parametrize("spine_p99, verdict", [(120.0, Verdict.PASS), (120.1, Verdict.FAIL)])
def test_latency_ratio_compares_spine_p99_with_layered_p99(spine_p99, verdict):
    result = latency_p99_ratio_gate(LAYERED, WindowStats(1000, 0, spine_p99), max_ratio=1.2, min_requests=10)
    assert result.verdict is verdict and result.value == pytest.approx(spine_p99 / 100.0)


@pytest.mark.parametrize("layered, spine", [(WindowStats(9, 0, 100.0), WindowStats(1000, 900, 999.0)),
                                            (WindowStats(1000, 0, 100.0), WindowStats(9, 9, 999.0))])
def test_too_few_requests_on_either_side_is_inconclusive(layered, spine):
    assert error_rate_gate(layered, spine, 0.01, min_requests=10).verdict is Verdict.INCONCLUSIVE
    assert latency_p99_ratio_gate(layered, spine, 1.2, min_requests=10).verdict is Verdict.INCONCLUSIVE
    assert "need 10 on each side" in error_rate_gate(layered, spine, 0.01, min_requests=10).message


def test_latency_without_a_layered_baseline_is_inconclusive():
    result = latency_p99_ratio_gate(WindowStats(100, 0, 0.0), WindowStats(100, 0, 5.0), 1.2, 10)
    assert result.verdict is Verdict.INCONCLUSIVE and result.value is None


def test_parity_fails_on_mismatches_over_the_limit_even_with_little_traffic():
    assert parity_gate(WindowStats(3, 0, 1.0), mismatches=1, max_mismatches=0, min_requests=10).verdict is Verdict.FAIL
    assert parity_gate(WindowStats(3, 0, 1.0), 0, 0, 10).verdict is Verdict.INCONCLUSIVE
    assert parity_gate(WindowStats(30, 0, 1.0), 2, 2, 10).verdict is Verdict.PASS


def test_a_dry_run_failure_is_recorded_but_does_not_fail_the_window():
    spine = WindowStats(1000, 500, 500.0)
    results = evaluate([GateSpec("error_rate", 0.01, dry_run=True), GateSpec("parity", 0)], LAYERED, spine,
                       mismatches=0, min_requests=10)
    assert [r.verdict for r in results] == [Verdict.FAIL, Verdict.PASS] and results[0].dry_run
    assert window_verdict(results) is Verdict.PASS


def test_window_verdict_fail_beats_inconclusive_beats_pass():
    spine_bad = WindowStats(1000, 500, 100.0)
    fail = error_rate_gate(LAYERED, spine_bad, 0.01, 10)
    unsure = error_rate_gate(LAYERED, WindowStats(1, 0, 1.0), 0.01, 10)
    ok = error_rate_gate(LAYERED, LAYERED, 0.01, 10)
    assert window_verdict([ok, unsure, fail]) is Verdict.FAIL
    assert window_verdict([ok, unsure]) is Verdict.INCONCLUSIVE
    assert window_verdict([ok]) is Verdict.PASS
    assert window_verdict([]) is Verdict.PASS


def test_evaluate_keeps_plan_order_and_names_each_gate():
    specs = [GateSpec("parity", 0), GateSpec("latency_p99_ratio", 1.2), GateSpec("error_rate", 0.01)]
    results = evaluate(specs, LAYERED, LAYERED, 0, 10)
    assert [r.gate for r in results] == ["parity", "latency_p99_ratio", "error_rate"]
