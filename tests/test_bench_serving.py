"""The serving-controls benchmark runs and reports every figure (numbers are not judged)."""

from __future__ import annotations

from bench.serving import measure_serving


def test_serving_bench_reports_priority_and_kv_figures() -> None:
    result = measure_serving(requests=8, max_tokens=4, rounds=1)
    for key in ("single_class_p50_ms", "latency_class_p50_ms", "throughput_class_p50_ms",
                "single_class_tokens_per_s", "mixed_tokens_per_s", "ms_per_token"):
        assert result[key] > 0, key
    assert result["kv_slots"] == 4
    assert result["kv"]["per_slot_bytes"] > 0 and "slots" in result["kv"]["formula"]
