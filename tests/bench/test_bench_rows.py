"""The fair-share and GenAI-telemetry rows of the bench measure (what they measure is the bench's)."""

from __future__ import annotations

import pytest

from bench import fair_share, genai_cost
from bench.settings import ONLY_PARTS, ROWS, parse_args

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def test_the_fair_share_row_measures_each_condition_and_describes_itself() -> None:
    row = fair_share.measure(rounds=1, seconds=0.4)
    conditions = {"alone", "fair", "fair-no-headroom", "fifo"}
    assert set(row["b_p95_wait_ms"]) == conditions and all(row["requests_b_per_condition"][c] > 0 for c in conditions)
    assert row["b_admitted_at_next_turn_pct"]["fair"] >= 0 and row["fair_vs_alone_p95"] > 0
    assert "with A flooding" in fair_share.describe(row)


def test_the_genai_row_measures_each_tracing_variant() -> None:
    row = genai_cost.measure(iterations=300)
    for variant in ("tracing_off", "tracing_sampled_out", "tracing_recorded"):
        assert row[variant]["with_p50_us"] > 0 and row[variant]["without_p50_us"] > 0
    assert row["added_p50_ms_tracing_off"] == round(row["tracing_off"]["added_p50_us"] / 1000.0, 4)
    assert "tracing off" in genai_cost.describe(row)


def test_both_rows_run_alone_from_the_command_line() -> None:
    assert set(ROWS) <= set(ONLY_PARTS)
    settings, _, _ = parse_args(["--only", "fair_share,genai_telemetry"], "")
    assert settings.only == ("fair_share", "genai_telemetry")
