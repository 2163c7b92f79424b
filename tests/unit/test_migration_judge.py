"""The judge on synthetic windows: what it flags, how sure, and how often it is wrong.

Seeded numpy samples stand in for a window's per-request latencies, so the false-alarm and
detection rates below are properties of the statistics, not of this machine's timing.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from migration.gates import ParityStats, Verdict, WindowStats
from migration.judge.samples import bucket_samples_ms
from migration.judge.score import CANNOT_TELL, FAIL, HIGH, MARGINAL, PASS, gate_results, judge_window
from migration.judge_spec import GroupSpec, JudgeSpec, MetricSpec
from migration.plan import PlanError, load_plan

AGREEING = ParityStats(compared=100, mismatches=0)
JUDGE = JudgeSpec()  # defaults: 98 %, margin 0.25 x the shift, latency 50 + errors 50 (critical)


def side(latencies: np.ndarray, errors: int = 0) -> WindowStats:
    """A window's side: every latency a successful request, plus `errors` failed ones."""
    samples = tuple(float(v) for v in latencies)
    return WindowStats(len(samples) + errors, errors, float(np.percentile(latencies, 99)), len(samples),
                       latency_samples_ms=samples)


def lognormal(rng: np.random.Generator, median_ms: float, n: int) -> np.ndarray:
    return rng.lognormal(np.log(median_ms), 0.35, n)


def test_a_spine_ten_percent_slower_at_p50_is_flagged_high_with_its_confidence() -> None:
    """400 requests a side, lognormal with sigma 0.25 (p99 about 1.8 x p50): flagged High in at
    least 95 of 100 trials, each time with p < 0.02 and an interval that clears its margin.
    (Wider spreads need more requests: at sigma 0.35, 300 a side catch it about half the time.)"""
    rng = np.random.default_rng(10)
    flagged = 0
    for _ in range(100):
        layered = side(rng.lognormal(np.log(20.0), 0.25, 400))
        spine = side(rng.lognormal(np.log(22.0), 0.25, 400))
        judgement = judge_window(JUDGE, layered, spine, AGREEING)
        latency = next(m for m in judgement.metrics if m.name == "latency")
        if latency.verdict == HIGH:
            flagged += 1
            assert latency.fails and latency.p_value is not None and latency.p_value < 0.02
            assert latency.low is not None and latency.high is not None
            assert 0.25 * latency.effect < latency.low < latency.effect < latency.high  # clears the margin
            assert "98% CI" in latency.message and "Mann-Whitney p=" in latency.message
            assert judgement.score == 50.0 and judgement.outcome == FAIL
    assert flagged >= 95


def test_two_identical_sides_score_at_least_90_in_95_of_100_trials() -> None:
    rng = np.random.default_rng(2024)
    passing = 0
    for _ in range(100):
        layered = side(lognormal(rng, 20.0, 300), errors=int(rng.binomial(300, 0.01)))
        spine = side(lognormal(rng, 20.0, 300), errors=int(rng.binomial(300, 0.01)))
        judgement = judge_window(JUDGE, layered, spine, AGREEING)
        passing += judgement.score is not None and judgement.score >= 90
    assert passing >= 95


def test_a_25_percent_regression_is_caught_in_95_of_100_trials() -> None:
    rng = np.random.default_rng(25)
    caught = 0
    for _ in range(100):
        judgement = judge_window(JUDGE, side(lognormal(rng, 20.0, 300)), side(lognormal(rng, 25.0, 300)), AGREEING)
        caught += judgement.outcome == FAIL
    assert caught >= 95


def test_too_few_samples_cannot_tell_and_holds_never_passes() -> None:
    rng = np.random.default_rng(3)
    judgement = judge_window(JUDGE, side(lognormal(rng, 20.0, 30)), side(lognormal(rng, 20.0, 30)), AGREEING)
    assert judgement.outcome == CANNOT_TELL
    assert {m.verdict for m in judgement.metrics} == {CANNOT_TELL}
    judge_row = gate_results(JUDGE, judgement)[0]
    assert (judge_row.gate, judge_row.verdict) == ("judge", Verdict.INCONCLUSIVE)
    assert "too few" in judgement.message


def test_a_side_without_per_request_samples_cannot_tell() -> None:
    counted = WindowStats(500, 0, 20.0, 500)  # a source that counts but keeps no latencies
    judgement = judge_window(JUDGE, counted, counted, AGREEING)
    latency = next(m for m in judgement.metrics if m.name == "latency")
    assert latency.verdict == CANNOT_TELL and "no per-request latency samples" in latency.message
    assert judgement.outcome == CANNOT_TELL


def test_a_critical_metric_failing_scores_zero_even_when_another_cannot_tell() -> None:
    rng = np.random.default_rng(4)
    layered = WindowStats(400, 0, 20.0, 400, latency_samples_ms=tuple(lognormal(rng, 20.0, 10)))
    spine = WindowStats(400, 40, 20.0, 360, latency_samples_ms=tuple(lognormal(rng, 20.0, 10)))
    judgement = judge_window(JUDGE, layered, spine, AGREEING)
    errors = next(m for m in judgement.metrics if m.name == "error_rate")
    assert errors.verdict == HIGH and errors.p_value is not None and errors.p_value < 0.001
    assert (judgement.score, judgement.outcome) == (0.0, FAIL)


def test_a_faster_spine_is_low_and_not_held_against_it() -> None:
    rng = np.random.default_rng(5)
    judgement = judge_window(JUDGE, side(lognormal(rng, 25.0, 300)), side(lognormal(rng, 20.0, 300)), AGREEING)
    latency = next(m for m in judgement.metrics if m.name == "latency")
    assert latency.verdict == "low" and not latency.fails
    assert judgement.outcome == PASS


def test_a_weighted_score_between_the_thresholds_is_marginal() -> None:
    spec = JudgeSpec(groups=(GroupSpec("latency", 20.0, (MetricSpec("latency", "latency"),)),
                             GroupSpec("errors", 80.0, (MetricSpec("error_rate", "error_rate"),))))
    rng = np.random.default_rng(6)
    judgement = judge_window(spec, side(lognormal(rng, 20.0, 300)), side(lognormal(rng, 30.0, 300)), AGREEING)
    assert (judgement.score, judgement.outcome) == (80.0, MARGINAL)
    assert gate_results(spec, judgement)[0].verdict is Verdict.INCONCLUSIVE


def test_outliers_beyond_the_iqr_fence_are_removed_before_the_test() -> None:
    rng = np.random.default_rng(7)
    spine = np.concatenate([lognormal(rng, 20.0, 300), [5000.0] * 6])  # six stalls, not a shift
    judgement = judge_window(JUDGE, side(lognormal(rng, 20.0, 300)), side(spine), AGREEING)
    latency = next(m for m in judgement.metrics if m.name == "latency")
    kept = int(latency.message.split("/ spine ")[1].split(",")[0])
    assert kept <= 300 and "outliers removed" in latency.message  # every stall dropped
    assert latency.verdict == PASS


def test_histogram_buckets_become_samples_at_their_midpoints() -> None:
    cumulative = {0.005: 2.0, 0.01: 5.0, 0.05: 6.0, float("inf"): 7.0}
    assert np.allclose(bucket_samples_ms(cumulative), (2.5, 2.5, 7.5, 7.5, 7.5, 30.0, 50.0))


def test_bucketed_sides_still_show_a_large_shift() -> None:
    rng = np.random.default_rng(8)
    bounds = [0.005 * i for i in range(1, 21)] + [float("inf")]

    def bucketed(values: np.ndarray) -> tuple[float, ...]:
        return bucket_samples_ms({le: float(np.sum(values / 1000.0 <= le)) for le in bounds})

    layered, spine = lognormal(rng, 20.0, 400), lognormal(rng, 26.0, 400)
    judgement = judge_window(JUDGE, WindowStats(400, 0, 1.0, 400, latency_samples_ms=bucketed(layered)),
                             WindowStats(400, 0, 1.0, 400, latency_samples_ms=bucketed(spine)), AGREEING)
    assert next(m for m in judgement.metrics if m.name == "latency").verdict == HIGH


PLAN = textwrap.dedent("""\
    name: judged
    judge:
      confidence: 0.95
      outliers: {method: iqr, factor: 1.5}
      thresholds: {pass: 80, marginal: 60}
      groups:
        - name: latency
          weight: 30
          metrics: [{name: latency, kind: latency, min_shift_ms: 1}]
        - name: correctness
          weight: 70
          metrics:
            - {name: errors, kind: error_rate, critical: true}
            - {name: parity, kind: parity, critical: true, max_mismatches: 2}
    stages:
      - {name: canary, spine_weight: 10, hold_s: 1}
      - {name: half, spine_weight: 50, hold_s: 1, judge: {confidence: 0.99}}
      - {name: quiet, spine_weight: 60, hold_s: 1, judge: false}
      - {name: all, spine_weight: 100, hold_s: 1}
    """)


def test_a_stage_judge_overrides_the_plans_field_by_field() -> None:
    plan = load_plan(PLAN)
    canary, half, quiet, everything = plan.stages
    assert canary.judge is not None and half.judge is not None
    assert (canary.judge.confidence, half.judge.confidence) == (0.95, 0.99)
    assert half.judge.pass_score == 80 and half.judge.iqr_factor == 1.5 and len(half.judge.groups) == 2
    assert quiet.judge is None and everything.judge is None  # said so; no baseline at 100 %
    assert plan.parity_gates() == ["judge.groups[1].metrics[1]"]


def test_a_judge_where_one_side_gets_no_traffic_is_refused() -> None:
    with pytest.raises(PlanError, match=r"stages\[3\]\.judge \(line 19\): a judge compares the spine with the "
                                        r"layered side, and spine_weight 100 leaves one of them no traffic"):
        load_plan(PLAN.replace("{name: all, spine_weight: 100, hold_s: 1}",
                               "{name: all, spine_weight: 100, hold_s: 1, judge: {min_samples: 10}}"))


def test_judge_problems_are_reported_with_their_lines() -> None:
    bad = (PLAN.replace("confidence: 0.95", "confidence: 2").replace("kind: latency", "kind: p42")
           .replace("name: correctness", "name: latency"))
    try:
        load_plan(bad)
    except PlanError as error:
        text = str(error)
    else:
        raise AssertionError("a plan with a bad judge loaded")
    assert "judge.confidence (line 3): must be between 0.5 and 0.9999, got 2" in text
    assert "judge.groups[0].metrics[0].kind (line 9): unknown metric kind 'p42'" in text
    assert "judge.groups[1].name (line 10): duplicate group name 'latency'" in text
