"""Gate arithmetic: pass, fail, inconclusive and dry run, on one window of each side."""

from __future__ import annotations

import pytest

from migration.gates import (
    ParityStats,
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
AGREEING = ParityStats(compared=50, mismatches=0)


def differing(mismatches: int, compared: int = 50) -> ParityStats:
    return ParityStats(compared, mismatches, {"tokens": mismatches})


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


def test_a_sub_millisecond_ratio_under_the_floor_passes():
    """The demo's old rollback: 0.25 ms against 0.1 ms is a ratio of 2.5, and 0.15 ms."""
    layered, spine = WindowStats(500, 0, 0.1), WindowStats(500, 0, 0.25)
    result = latency_p99_ratio_gate(layered, spine, max_ratio=2.0, min_requests=10)
    assert result.verdict is Verdict.PASS and result.value == pytest.approx(2.5)
    assert "> max_ratio 2" in result.message and "<= min_delta_ms 5" in result.message


def test_a_real_regression_fails_above_both_the_ratio_and_the_floor():
    layered = WindowStats(500, 0, 4.0)
    assert latency_p99_ratio_gate(layered, WindowStats(500, 0, 12.0), 2.0, 10).verdict is Verdict.FAIL
    assert latency_p99_ratio_gate(layered, WindowStats(500, 0, 8.9), 2.0, 10).verdict is Verdict.PASS  # 4.9 ms apart
    # The floor is the plan's to set: 1 ms apart fails a gate whose floor is 0.5 ms.
    tight = latency_p99_ratio_gate(WindowStats(500, 0, 0.1), WindowStats(500, 0, 1.1), 2.0, 10, min_delta_ms=0.5)
    assert tight.verdict is Verdict.FAIL and "> min_delta_ms 0.5" in tight.message


def test_latency_is_judged_on_enough_successful_requests_on_each_side():
    """1000 requests, 995 of them refused in microseconds: 5 answers are no p99."""
    mostly_refused = WindowStats(1000, 0, 50.0, ok_requests=5)
    result = latency_p99_ratio_gate(LAYERED, mostly_refused, 1.2, min_requests=10)
    assert result.verdict is Verdict.INCONCLUSIVE and "too few successful requests" in result.message
    assert error_rate_gate(LAYERED, mostly_refused, 0.01, min_requests=10).verdict is Verdict.PASS


def test_no_data_is_never_a_pass_even_without_a_minimum():
    nothing = WindowStats(0, 0, None, 0)
    for gate in (error_rate_gate(LAYERED, nothing, 0.5, min_requests=0),
                 latency_p99_ratio_gate(LAYERED, nothing, 100.0, min_requests=0),
                 parity_gate(nothing, ParityStats(0, 0), 0, min_requests=0)):
        assert gate.verdict is Verdict.INCONCLUSIVE, gate


def test_a_side_the_source_could_not_read_holds_every_gate():
    unread = WindowStats(1000, 0, 10.0, missing="cannot query Prometheus at http://prometheus:9090: timed out")
    results = evaluate([GateSpec("error_rate", 0.5), GateSpec("latency_p99_ratio", 100.0), GateSpec("parity", 0)],
                       LAYERED, unread, AGREEING, 10)
    assert [r.verdict for r in results] == [Verdict.INCONCLUSIVE] * 3
    assert all("cannot query Prometheus" in r.message for r in results)
    assert parity_gate(unread, differing(3), 0, 10).verdict is Verdict.FAIL  # mismatches over the limit still fail


def test_a_gate_may_ask_for_more_requests_than_the_plan():
    spine = WindowStats(50, 0, 100.0)
    default, strict = evaluate([GateSpec("latency_p99_ratio", 1.2), GateSpec("latency_p99_ratio", 1.2, min_requests=100)],
                               LAYERED, spine, AGREEING, min_requests=10)
    assert default.verdict is Verdict.PASS and strict.verdict is Verdict.INCONCLUSIVE


def test_latency_without_a_layered_baseline_is_inconclusive():
    result = latency_p99_ratio_gate(WindowStats(100, 0, 0.0), WindowStats(100, 0, 5.0), 1.2, 10)
    assert result.verdict is Verdict.INCONCLUSIVE and result.value is None


def test_parity_fails_on_mismatches_over_the_limit_even_with_little_traffic():
    failed = parity_gate(WindowStats(3, 0, 1.0), differing(1), max_mismatches=0, min_requests=10)
    assert failed.verdict is Verdict.FAIL and "1 decision mismatches in 50 shadow comparisons (tokens 1)" in failed.message
    assert parity_gate(WindowStats(3, 0, 1.0), AGREEING, 0, 10).verdict is Verdict.INCONCLUSIVE
    assert parity_gate(WindowStats(30, 0, 1.0), differing(2), 2, 10).verdict is Verdict.PASS


def test_a_window_without_shadow_comparisons_is_inconclusive_not_a_pass():
    none_compared = parity_gate(WindowStats(30, 0, 1.0), ParityStats(0, 0), 0, 10)
    assert none_compared.verdict is Verdict.INCONCLUSIVE and "no shadow comparisons" in none_compared.message
    unread = parity_gate(WindowStats(30, 0, 1.0), ParityStats(0, 0, missing="no endpoint answered"), 0, 10)
    assert unread.verdict is Verdict.INCONCLUSIVE and "no endpoint answered" in unread.message


def test_mismatches_in_noisy_fields_are_named_but_not_counted():
    noisy = ParityStats(40, 0, {"cached": 7}, noisy_fields=("cached",))
    result = parity_gate(WindowStats(30, 0, 1.0), noisy, 0, 10)
    assert result.verdict is Verdict.PASS and "noisy, not counted: cached" in result.message


def test_a_dry_run_failure_is_recorded_but_does_not_fail_the_window():
    spine = WindowStats(1000, 500, 500.0)
    results = evaluate([GateSpec("error_rate", 0.01, dry_run=True), GateSpec("parity", 0)], LAYERED, spine,
                       parity=AGREEING, min_requests=10)
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
    results = evaluate(specs, LAYERED, LAYERED, AGREEING, 10)
    assert [r.gate for r in results] == ["parity", "latency_p99_ratio", "error_rate"]


@pytest.mark.parametrize("spine_errors, verdict", [(0, Verdict.INCONCLUSIVE), (400, Verdict.INCONCLUSIVE),
                                                   (510, Verdict.INCONCLUSIVE), (511, Verdict.FAIL)])
def test_a_failing_baseline_is_never_a_reason_to_pass(spine_errors, verdict):
    """A legacy side that fails half its requests (an endpoint going down) is its own error:
    the window says nothing for the spine (the stage holds), unless the spine fails even more."""
    failing_legacy = WindowStats(requests=1000, errors=500, p99_ms=100.0)
    result = error_rate_gate(failing_legacy, WindowStats(1000, spine_errors, 90.0), max_delta=0.01, min_requests=10)
    assert result.verdict is verdict
    if verdict is Verdict.INCONCLUSIVE:
        assert "never a reason to pass the spine" in result.message
