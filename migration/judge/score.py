"""The judge's verdict on one window: each metric's verdict, the group-weighted score, the outcome.

As Kayenta scores a canary: per metric pass, High or Low (or cannot tell); a group scores
pass ÷ (pass + high + low) × 100 over its metrics that could tell; the stage's score is
the groups' weighted mean; any failing critical metric makes it 0. At or above the pass
threshold the window passes (the stage may advance), at or above marginal it holds for
another window, below it fails (the stage's failure_limit then rolls back). A metric that
cannot tell (too few samples, a side not read) holds the window: it is never counted as a
pass — only a critical metric already failing decides without it.

The controller reads the outcome as one gate row, `judge` (its value the score, its
threshold the pass score); beside it one row per metric, `judge.NAME`, carries that
metric's verdict, effect size (its value) against its margin (its threshold) and its
interval (in its message) into the gate history and the dashboard without counting on
its own (`GateResult.counts`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from migration.gates import GateResult, ParityStats, Verdict, WindowStats, parity_gate
from migration.judge.statistics import compare_errors, location_shift, without_outliers
from migration.judge_spec import JudgeSpec, MetricSpec

PASS, HIGH, LOW, CANNOT_TELL = "pass", "high", "low", "cannot tell"
METRIC_ROW = "judge."  # the prefix of a per-metric row's gate name: recorded, never counting on its own
MARGINAL, FAIL = "marginal", "fail"


@dataclass(frozen=True)
class MetricVerdict:
    """One metric in one window. `effect`: the Hodges–Lehmann shift (ms) for latency, the
    error-rate difference for errors, the mismatch count for parity; `low`/`high`: the
    interval at the judge's confidence (latency: of the shift; errors: of the odds ratio)."""

    name: str
    group: str
    kind: str
    critical: bool
    verdict: str
    fails: bool
    effect: float | None
    low: float | None
    high: float | None
    p_value: float | None
    message: str
    margin: float | None = None  # what the effect is held against: the shift's margin, max_delta, max_mismatches


@dataclass(frozen=True)
class Judgement:
    score: float | None  # None: no metric could tell
    outcome: str  # pass, marginal, fail, cannot tell
    metrics: tuple[MetricVerdict, ...]
    message: str


def judge_window(spec: JudgeSpec, layered: WindowStats, spine: WindowStats, parity: ParityStats,
                 names: tuple[str, str] = ("layered", "spine")) -> Judgement:
    """Every metric of `spec` on one window, then the score and the outcome (module doc).

    `names`: what the messages call the baseline and the candidate (`spine ab` compares layouts)."""
    verdicts = tuple(_metric(spec, group.name, metric, layered, spine, parity, names)
                     for group in spec.groups for metric in group.metrics)
    told = [v for v in verdicts if v.verdict != CANNOT_TELL]
    weighted = [(group.weight, [v for v in told if v.group == group.name]) for group in spec.groups]
    weighted = [(weight, group) for weight, group in weighted if group]
    score = None
    if weighted:
        total = sum(weight for weight, _ in weighted)
        score = sum(weight * 100.0 * sum(not v.fails for v in group) / len(group) for weight, group in weighted) / total
    critical = [v.name for v in verdicts if v.critical and v.fails]
    unknown = [v.name for v in verdicts if v.verdict == CANNOT_TELL]
    if critical:
        score, outcome = 0.0, FAIL
        head = f"score 0: critical metric {', '.join(critical)} failed"
    elif unknown:
        outcome = CANNOT_TELL
        head = (f"cannot tell ({', '.join(unknown)} could not be judged), holding"
                + (f"; score so far {score:.1f}" if score is not None else ""))
    else:
        assert score is not None
        if score >= spec.pass_score:
            outcome, head = PASS, f"score {score:.1f} >= pass {spec.pass_score:g}"
        elif score >= spec.marginal_score:
            outcome, head = MARGINAL, (f"marginal: score {score:.1f} < pass {spec.pass_score:g}, >= marginal "
                                       f"{spec.marginal_score:g}, holding the stage for another window")
        else:
            outcome, head = FAIL, f"score {score:.1f} < marginal {spec.marginal_score:g}"
    detail = "; ".join(f"{v.name} {v.message}" for v in verdicts)
    return Judgement(score, outcome, verdicts, f"{head} (at {spec.confidence:.0%} confidence): {detail}")


def gate_results(spec: JudgeSpec, judgement: Judgement) -> list[GateResult]:
    """The judge's row (the one that counts) and one row per metric (module doc)."""
    verdict = {PASS: Verdict.PASS, FAIL: Verdict.FAIL}.get(judgement.outcome, Verdict.INCONCLUSIVE)
    rows = [GateResult("judge", verdict, judgement.score, spec.pass_score, spec.dry_run, judgement.message)]
    for metric in judgement.metrics:
        state = (Verdict.INCONCLUSIVE if metric.verdict == CANNOT_TELL
                 else Verdict.FAIL if metric.fails else Verdict.PASS)
        margin = metric.margin if metric.margin is not None else 0.0
        rows.append(GateResult(f"{METRIC_ROW}{metric.name}", state, metric.effect, margin, spec.dry_run,
                               metric.message, counts=False))
    return rows


def judge_gates(spec: JudgeSpec, layered: WindowStats, spine: WindowStats, parity: ParityStats) -> list[GateResult]:
    return gate_results(spec, judge_window(spec, layered, spine, parity))


def _metric(spec: JudgeSpec, group: str, metric: MetricSpec, layered: WindowStats, spine: WindowStats,
            parity: ParityStats, names: tuple[str, str]) -> MetricVerdict:
    base, candidate = names

    def cannot(why: str) -> MetricVerdict:
        return MetricVerdict(metric.name, group, metric.kind, metric.critical, CANNOT_TELL, False, None, None, None,
                             None, f"cannot tell: {why}")

    if metric.kind == "parity":
        gate = parity_gate(spine, parity, metric.max_mismatches, spec.min_samples)
        verdict = {Verdict.PASS: PASS, Verdict.FAIL: HIGH}.get(gate.verdict, CANNOT_TELL)
        return MetricVerdict(metric.name, group, metric.kind, metric.critical, verdict, verdict == HIGH, gate.value,
                             None, None, None, f"{verdict}: {gate.message}" if verdict != CANNOT_TELL
                             else f"cannot tell: {gate.message}", float(metric.max_mismatches))
    gaps = [f"{side}: {stats.missing}" for side, stats in ((base, layered), (candidate, spine)) if stats.missing]
    if gaps:
        return cannot("no data: " + "; ".join(gaps))
    if metric.kind == "error_rate":
        if min(layered.requests, spine.requests) < spec.min_samples:
            return cannot(f"too few requests: {base} {layered.requests}, {candidate} {spine.requests}, "
                          f"need {spec.min_samples} on each side")
        return _errors(spec, group, metric, layered, spine, names)
    return _latency(spec, group, metric, layered, spine, names, cannot)


def _errors(spec: JudgeSpec, group: str, metric: MetricSpec, layered: WindowStats,
            spine: WindowStats, names: tuple[str, str]) -> MetricVerdict:
    if layered.errors == 0 and spine.errors == 0:  # nothing to test: the odds ratio is undefined
        return MetricVerdict(metric.name, group, metric.kind, metric.critical, PASS, False, 0.0, None, None, 1.0,
                             f"pass: no layout errors on either side ({names[0]} {layered.requests}, "
                             f"{names[1]} {spine.requests} requests)", metric.max_delta)
    test = compare_errors(layered.errors, layered.requests, spine.errors, spine.requests, spec.confidence)
    high = test.p_value < 1 - spec.confidence and test.delta > metric.max_delta
    verdict = HIGH if high else PASS
    message = (f"{verdict}: {names[1]} error rate {test.spine_rate:.4f} vs {names[0]} {test.layered_rate:.4f} "
               f"(delta {test.delta:+.4f}, tolerated {metric.max_delta:g}), odds ratio {_num(test.odds_ratio)} "
               f"{spec.confidence:.0%} CI [{_num(test.low)}, {_num(test.high)}], Fisher p={test.p_value:.2g}")
    return MetricVerdict(metric.name, group, metric.kind, metric.critical, verdict, high, test.delta,
                         _finite(test.low), _finite(test.high), test.p_value, message, metric.max_delta)


def _latency(spec: JudgeSpec, group: str, metric: MetricSpec, layered: WindowStats, spine: WindowStats,
             names: tuple[str, str], cannot: Callable[[str], MetricVerdict]) -> MetricVerdict:
    sides = [np.asarray(stats.latency_samples_ms, dtype=np.float64) for stats in (layered, spine)]
    if min(s.size for s in sides) == 0 and min(layered.successes, spine.successes) >= spec.min_samples:
        return cannot("this data path gave no per-request latency samples")
    kept = [without_outliers(s, spec.outliers, spec.iqr_factor) for s in sides]
    if min(k.size for k in kept) < spec.min_samples:
        return cannot(f"too few latency samples: {names[0]} {kept[0].size}, {names[1]} {kept[1].size} "
                      f"(outliers removed), "
                      f"need {spec.min_samples} on each side")
    shift = location_shift(kept[0], kept[1], spec.confidence, removed=sum(s.size for s in sides) - sum(k.size for k in kept))
    margin = spec.effect_size * abs(shift.estimate)
    sure = shift.p_value < 1 - spec.confidence
    verdict = PASS
    if sure and shift.low > margin and shift.estimate > metric.min_shift_ms:
        verdict = HIGH
    elif sure and shift.high < -margin and -shift.estimate > metric.min_shift_ms:
        verdict = LOW
    fails = (verdict == HIGH and metric.direction in ("increase", "either")) or \
            (verdict == LOW and metric.direction in ("decrease", "either"))
    relative = f" ({shift.relative:+.1%})" if shift.relative is not None else ""
    label = verdict if fails or verdict == PASS else f"{verdict} (allowed: direction {metric.direction})"
    message = (f"{label}: {names[1]} latency shifted {shift.estimate:+.3f} ms{relative} (Hodges-Lehmann), "
               f"{spec.confidence:.0%} CI [{shift.low:+.3f}, {shift.high:+.3f}] ms, margin ±{margin:.3f} ms, "
               f"Mann-Whitney p={shift.p_value:.2g}, n {names[0]} {shift.layered_n} / {names[1]} {shift.spine_n}"
               + (f", {shift.removed} outliers removed" if shift.removed else ""))
    return MetricVerdict(metric.name, group, metric.kind, metric.critical, verdict, fails, shift.estimate,
                         _finite(shift.low), _finite(shift.high), shift.p_value, message, margin)


def _num(value: float) -> str:
    return f"{value:.3g}" if math.isfinite(value) else ("inf" if value > 0 else "nan")


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
