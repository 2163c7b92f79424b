"""The legacy row's arithmetic (bench/legacy.py): cells, paired added latency, the targets.

What it measures is `make bench`'s business; here, that it reads k6's turns as it says."""

from __future__ import annotations

from typing import Any

import pytest

from bench import legacy


def _turn(p50: float, rps: float, requests: int = 100, gateway_s: float = 0.1) -> dict[str, Any]:
    return {"p50_ms": p50, "p99_ms": p50 * 3, "requests": requests, "rps": rps, "failed": 0,
            "gateway_cpu_s": gateway_s, "upstream_cpu_s": None, "driver_cpu_s": 0.05, "wall_s": 1.0}


def _turns(bare: list[float], spine: list[float], litellm: list[float], rps: dict[str, float]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for target, p50s in (("bare", bare), ("spine-upstream", spine), ("spine-inprocess", spine),
                         ("litellm", litellm)):
        out[target] = {1: [_turn(p, 100.0) for p in p50s], 64: [_turn(10.0, rps[target]) for _ in p50s]}
    return out


def test_added_latency_is_paired_round_by_round_and_the_targets_judged() -> None:
    turns = _turns(bare=[5.0, 9.0, 5.0], spine=[5.5, 9.6, 5.9], litellm=[20.0, 30.0, 21.0],
                   rps={"bare": 400.0, "spine-upstream": 390.0, "spine-inprocess": 380.0, "litellm": 50.0})
    cells = {t: {str(c): legacy._cell(turns[t][c]) for c in (1, 64)} for t in turns}
    judged = legacy._judge(cells, turns)
    assert judged["spine-upstream_added_p50_ms_c1"] == pytest.approx(0.6)  # median of 0.5, 0.6, 0.9
    assert judged["litellm_added_p50_ms_c1"] == pytest.approx(16.0)
    assert judged["spine-upstream_throughput_vs_bare_c64"] == pytest.approx(0.975)
    assert judged["targets"] == {"spine_upstream_adds_at_most_1ms_p50_c1": True,
                                 "spine_upstream_adds_at_most_half_of_litellm": True,
                                 "spine_upstream_throughput_c64_at_least_0.95_of_bare": True}
    assert cells["bare"]["1"]["gateway_cpu_ms_per_request"] == pytest.approx(1.0)  # 0.3 s over 300 requests


def test_a_missed_target_is_said_and_litellm_left_out_when_absent() -> None:
    turns = _turns(bare=[5.0], spine=[7.0], litellm=[6.0], rps={"bare": 400.0, "spine-upstream": 300.0,
                                                                "spine-inprocess": 380.0, "litellm": 50.0})
    del turns["litellm"]
    cells = {t: {str(c): legacy._cell(turns[t][c]) for c in (1, 64)} for t in turns}
    judged = legacy._judge(cells, turns)
    assert judged["targets"]["spine_upstream_adds_at_most_1ms_p50_c1"] is False
    assert judged["targets"]["spine_upstream_adds_at_most_half_of_litellm"] is None
    assert judged["targets"]["spine_upstream_throughput_c64_at_least_0.95_of_bare"] is False


def test_without_k6_the_row_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(legacy.shutil, "which", lambda name: None)
    monkeypatch.setattr(legacy.sys, "executable", "/nonexistent/python")
    row = legacy.measure_legacy()
    assert "k6 is not installed" in row["skipped"] and legacy.describe(row).startswith("legacy: skipped")
