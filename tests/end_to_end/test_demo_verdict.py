"""The demo's stage table: its verdict on each stage, decided from the numbers."""

from __future__ import annotations

from rich.console import Console

from spine.tools.demo.migration import (
    MIN_P99_REQUESTS,
    SPINE_FASTER,
    RunReport,
    SideLoad,
    StageRow,
    stage_table,
    verdict,
)

LAYERED = SideLoad(p50_ms=40.0, p99_ms=90.0, requests=120, concurrency=2.0)


def test_faster_at_both_percentiles_is_faster() -> None:
    assert verdict(LAYERED, SideLoad(30.0, 80.0, 60, 2.0)) == SPINE_FASTER


def test_a_side_without_requests_or_with_too_few_for_a_p99_says_so() -> None:
    assert verdict(SideLoad(), SideLoad(30.0, 80.0, 60, 3.0)) == "no layered requests to compare"
    assert verdict(LAYERED, SideLoad()) == "no spine requests to compare"
    few = MIN_P99_REQUESTS - 1
    # Even a faster spine: a p99 of so few requests is its slowest one, or next to it.
    assert verdict(LAYERED, SideLoad(10.0, 20.0, few, 1.0)) == f"too few spine requests for a p99 (n={few})"
    assert verdict(SideLoad(40.0, 90.0, 3, 1.0), SideLoad(30.0, 80.0, 60, 1.0)) == \
        "too few layered requests for a p99 (n=3)"


def test_a_slower_spine_carrying_clearly_more_concurrency_is_told_apart_from_a_regression() -> None:
    assert verdict(LAYERED, SideLoad(50.0, 120.0, 80, 2.9)) == "spine carried more concurrency (2.9 vs 2.0)"
    # Within the margin (0.5 more, 1.25x): equal concurrency, so a slower spine is a regression.
    assert verdict(LAYERED, SideLoad(50.0, 120.0, 80, 2.4)) == (
        "spine slower at equal or lower concurrency (p50 50.0 vs 40.0 ms, p99 120.0 vs 90.0 ms): "
        "see `make profile`")
    low = SideLoad(p50_ms=40.0, p99_ms=90.0, requests=120, concurrency=0.2)
    assert verdict(low, SideLoad(50.0, 120.0, 80, 0.6)).startswith("spine slower")  # 3x, but only 0.4 more
    # Faster at p50 only is not faster.
    assert verdict(LAYERED, SideLoad(30.0, 95.0, 80, 1.0)).startswith("spine slower at equal or lower concurrency")


def test_the_table_shows_each_stage_verdict_and_the_summary_counts_the_faster_stages() -> None:
    report = RunReport("promoted", rows=[
        StageRow("half", 50, ["auth"], "-", 90.0, 80.0, (150, 150), LAYERED, SideLoad(30.0, 80.0, 60, 2.0)),
        StageRow("all-spine", 100, ["auth"], "-", 0.0, 80.0, (0, 300), SideLoad(), SideLoad(30.0, 80.0, 60, 4.0)),
    ])
    console = Console(width=300, record=True)
    console.print(stage_table("t", report))
    text = console.export_text()
    assert "40.0/90.0" in text and "30.0/80.0" in text and "120/60" in text and "2.0/2.0" in text
    assert SPINE_FASTER in text and "no layered requests to compare" in text
    # The 100% stage has no layered baseline (nor one with a few stragglers): not counted.
    assert report.faster() == "spine faster at 1/1 stages with enough requests on both sides"
    report.rows.append(StageRow("slow", 30, ["auth"], "-", 90.0, 80.0, (150, 150), LAYERED,
                                SideLoad(50.0, 120.0, 60, 1.0)))
    assert report.faster() == "spine faster at 1/2 stages with enough requests on both sides"
