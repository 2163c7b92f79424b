"""The capacity curve's arithmetic: Poisson arrivals, the knee on synthetic curves, and the
device regime's summary in results.json's terms. No server: the open-loop driver itself runs
in `make bench` (bench.capacity.send_open_loop, on spine.tools.workload.generator.open_loop)."""

from __future__ import annotations

import random
import statistics

from bench.capacity import Point, knee, measure_capacity, rates, stopped
from bench.device_regime import capacity_summary, summarize
from spine.tools.workload.generator import poisson_offsets


def point(rate: float, p99: float, errors: int = 0, cpu: float = 100.0) -> Point:
    return Point(offered_rps=rate, sent=100, ok=100 - errors, errors=errors, p50_ms=p99 / 2, p99_ms=p99,
                 late_p99_ms=0.0, answered_rps=rate, cpu_us_per_request=cpu)


def test_poisson_arrivals_come_at_the_offered_rate_with_exponential_gaps() -> None:
    offsets = poisson_offsets(200.0, 50.0, random.Random(1))
    gaps = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    assert all(0 <= t < 50.0 for t in offsets) and offsets == sorted(offsets)
    assert abs(len(offsets) / 50.0 - 200.0) < 10  # ~10,000 arrivals: within 5% of the rate
    assert abs(statistics.mean(gaps) - statistics.stdev(gaps)) < 0.0005  # exponential: mean == stdev
    assert rates(25, 2, 200) == [25, 50, 100, 200]


def test_the_knee_is_the_last_rate_that_held_before_p99_passed_one_and_a_half_times_low_load() -> None:
    curve = [point(25, 10), point(50, 11), point(100, 14), point(200, 16), point(400, 40), point(800, 90)]
    at = knee(curve)
    assert at is not None and at.offered_rps == 100  # 16 ms > 1.5 × 10 ms: 200 broke, and 400 too
    assert stopped(curve) and not stopped(curve[:4])


def test_one_bad_rate_is_not_a_knee_but_refusals_are() -> None:
    blip = [point(25, 10), point(50, 30), point(100, 12), point(200, 13), point(400, 60), point(800, 70)]
    at = knee(blip)
    assert at is not None and at.offered_rps == 200  # the one slow rate at 50 was followed by two that held
    refusing = [point(25, 10), point(50, 11), point(100, 11, errors=3), point(200, 11, errors=9)]
    at = knee(refusing)
    assert at is not None and at.offered_rps == 50
    assert knee([point(25, 10, errors=1)]) is None
    never = [point(25, 10), point(50, 11)]
    assert knee(never) is not None and knee(never).offered_rps == 50  # type: ignore[union-attr]


def test_measure_capacity_stops_each_layout_at_its_own_knee(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    knees = {"collapsed": 400.0, "layered": 100.0}

    def fake_point(endpoint: str, rate: float, duration_s: float, **_: object) -> Point:
        return point(rate, 10.0 if rate <= knees[endpoint] else 10.0 * rate / knees[endpoint] + 10)

    monkeypatch.setattr("bench.capacity.measure_point", fake_point)
    seen: list[tuple[str, float]] = []
    result = measure_capacity({"collapsed": "collapsed", "layered": "layered"},  # type: ignore[dict-item]
                              {"collapsed": lambda: 0.0, "layered": lambda: 0.0}, model_id="sim", start_rps=25,
                              growth=2, max_rps=3200, report=lambda layout, p: seen.append((layout, p.offered_rps)))
    summary = capacity_summary(result)
    assert summary["collapsed"]["knee_rps"] == 400 and summary["layered"]["knee_rps"] == 100
    assert summary["layered"]["cpu_us_per_request"] == 100.0 and summary["layered"]["p99_ms_at_knee"] == 10.0
    assert max(rate for layout, rate in seen if layout == "layered") == 400  # two breaking rates, then stop
    assert result["collapsed"]["curve_ended"] == "broke"


def test_the_device_summary_reports_collapsed_over_bare_per_concurrency_and_the_targets() -> None:
    runs = [{"layout": layout, "mode": "unary", "concurrency": c, "requests": 10, "errors": 0,
             "cpu_ms_per_request": cpu, "p50_vs_bare": 1.01, "p99_vs_bare": 1.2, "rps_vs_bare": 0.99}
            for c in (1, 16, 64, 256) for layout, cpu in (("bare", 0.5), ("collapsed", 1.0), ("layered", 3.0))]
    runs += [{"layout": layout, "mode": "stream", "concurrency": 1, "ttft_p50_ms": ttft, "requests": 5, "errors": 0}
             for layout, ttft in (("bare", 10.0), ("collapsed", 10.2))]
    capacity = {"collapsed": {"knee_rps": 300.0}, "layered": {"knee_rps": 100.0}, "bare": {"knee_rps": 400.0}}
    summary = summarize(runs, capacity)
    assert set(summary["collapsed_vs_bare"]) == {"1", "16", "64", "256"}
    assert summary["collapsed_vs_bare"]["16"] == {"p50": 1.01, "p99": 1.2, "rps": 0.99}
    assert summary["ttft_collapsed_vs_bare"] == 1.02
    assert summary["cpu_us_per_request"] == {"bare": 500.0, "collapsed": 1000.0, "layered": 3000.0}
    targets = summary["targets"]
    assert targets["rps_c16"] and targets["p50_c1"] and not targets["p99_c1"] and targets["ttft"]
    assert targets["layered_over_collapsed_cpu"] and targets["collapsed_over_layered_knee"]
