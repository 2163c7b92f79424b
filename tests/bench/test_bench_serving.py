"""The serving-controls benchmark runs and reports every figure (numbers are not judged)."""

from __future__ import annotations

import pytest

from bench.serving import measure_serving


def test_serving_bench_reports_priority_and_kv_figures() -> None:
    result = measure_serving(requests=8, max_tokens=4, rounds=1)
    for key in ("single_class_p50_ms", "latency_class_p50_ms", "throughput_class_p50_ms",
                "single_class_tokens_per_s", "mixed_tokens_per_s", "ms_per_token"):
        assert result[key] > 0, key
    assert result["kv_slots"] == 4
    assert result["kv"]["per_slot_bytes"] > 0 and "slots" in result["kv"]["formula"]


def test_system_prompt_bench_reports_kv_bytes_and_ttft_with_and_without_reuse() -> None:
    from bench.serving import measure_system_prompt

    result = measure_system_prompt(requests=12, max_tokens=3, rounds=1, slots=4)
    assert result["requests"] == 12 and result["system_prompt_tokens"] > 100
    assert 0 < result["kv_bytes_with_reuse"] < result["kv_bytes_without_reuse"]
    assert result["kv_ratio"] == round(result["kv_bytes_with_reuse"] / result["kv_bytes_without_reuse"], 3)
    assert result["ttft_p50_ms_with_reuse"] > 0 and result["ttft_p50_ms_without_reuse"] > 0


def test_system_prompt_hf_bench_reports_kv_bytes_ttft_and_the_prefill_it_saves() -> None:
    pytest.importorskip("transformers")
    from bench.serving import measure_system_prompt_hf

    result = measure_system_prompt_hf(requests=12, max_tokens=3, rounds=1, slots=4)
    assert result["requests"] == 12 and result["system_prompt_tokens"] > 100
    assert result["prefix_hits"] > 0
    # Whole slots either way; with reuse, the stored copy of the prefix besides.
    assert 0 < result["kv_bytes_without_reuse"] < result["kv_bytes_with_reuse"]
    assert result["kv_ratio"] == round(result["kv_bytes_with_reuse"] / result["kv_bytes_without_reuse"], 3)
    assert 0 < result["forwarded_tokens_with_reuse"] < result["forwarded_tokens_without_reuse"]
    assert result["ttft_p50_ms_with_reuse"] > 0 and result["ttft_p50_ms_without_reuse"] > 0


def test_only_names_serving_rows_and_refuses_others() -> None:
    from bench.run import parse_args

    settings, _, _ = parse_args(["--only", "system_prompt, system_prompt_hf"])
    assert settings.only == ("system_prompt", "system_prompt_hf")
    with pytest.raises(SystemExit):
        parse_args(["--only", "runs"])
