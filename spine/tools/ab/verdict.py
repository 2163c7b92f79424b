"""The A/B's verdict: each layout against the first one up, judged as a migration stage is.

A table of percentiles says one layout was faster in this run; the judge
(`migration.judge`) says whether the difference is more than noise, how large it is, and
how sure: the Hodges–Lehmann shift of the successful requests' latency with its confidence
interval (Mann-Whitney U), and the layout errors compared with Fisher's exact test. The
score uses the migration's defaults (latency 50, errors 50 and critical; pass 90, marginal
75), a faster layout never counted against it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from migration.gates import ParityStats, WindowStats
from migration.judge.score import judge_window
from migration.judge_spec import JudgeSpec
from runtime.shadow.decisions import LAYOUT_ERRORS
from spine.tools.ab.interleave import ABRun, LayoutRun

JUDGE = JudgeSpec()
NO_PARITY = ParityStats(0, 0, missing="an A/B compares decisions apart (the parity section)")


def layout_stats(run: LayoutRun, mode: str) -> WindowStats:
    """What the judge reads of one layout: its requests, layout errors and OK latencies (ms)."""
    done = [(index, r) for index, r in enumerate(run.results) if r is not None]
    errors = sum(r.code.name in LAYOUT_ERRORS for _, r in done)
    latencies = [run.scheduled_latency_s[index] if mode == "open" else r.latency_s for index, r in done if r.ok]
    samples = tuple(v * 1000.0 for v in latencies if v is not None)
    return WindowStats(len(done), errors, None, len(samples), latency_samples_ms=samples)


def layout_verdicts(ab: ABRun) -> dict[str, Any]:
    """{base, confidence, vs: {layout: {score, outcome, message, metrics: [...]}}}; empty with fewer
    than two layouts up."""
    up = [run for run in ab.runs if run.status == "up"]
    if len(up) < 2:
        return {}
    base = layout_stats(up[0], ab.options.mode)
    verdicts = {}
    for run in up[1:]:
        judgement = judge_window(JUDGE, base, layout_stats(run, ab.options.mode), NO_PARITY, (up[0].name, run.name))
        verdicts[run.name] = {
            "score": judgement.score, "outcome": judgement.outcome, "message": judgement.message,
            "metrics": [{"name": m.name, "verdict": m.verdict, "effect": m.effect, "low": m.low, "high": m.high,
                         "p_value": m.p_value, "message": m.message} for m in judgement.metrics]}
    return {"base": up[0].name, "confidence": JUDGE.confidence, "vs": verdicts}


def verdict_lines(report: Mapping[str, Any]) -> list[str]:
    """One line per layout compared, then one per metric (the console and the Markdown)."""
    verdict = report.get("verdict") or {}
    lines = []
    for name, result in (verdict.get("vs") or {}).items():
        score = "—" if result["score"] is None else f"{result['score']:.0f}"
        lines.append(f"{name} vs {verdict['base']}: {result['outcome']}, score {score} "
                     f"(judged at {verdict['confidence']:.0%} confidence)")
        lines += [f"  {metric['name']}: {metric['message']}" for metric in result["metrics"]]
    return lines
