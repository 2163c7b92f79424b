"""The gates' production source: PromQL against a real Prometheus server.

Two /metrics endpoints per side (each a MetricsService behind its HTTP server, standing for
one pod), scraped every 0.5 s by a real `prometheus` process. Known requests are recorded;
the windows the source reads back are checked against them. `increase()` extrapolates a
window's first and last scrape to its edges, so a count over series that existed before
the window is exact only up to that factor (checked against its bound); a series born in
the window counts exactly.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from migration.gates import ParityStats, Verdict, WindowStats, evaluate, window_verdict
from migration.judge.score import judge_window
from migration.judge_spec import JudgeSpec
from migration.metrics.promql import PrometheusSource, check_selector, p99_query, requests_query
from migration.plan import GateSpec
from tests.metrics_endpoints import MetricsEndpoint
from tests.prometheus_server import SCRAPE_INTERVAL_S, PrometheusServer, free_port, run_prometheus

JOBS = {"layered": ("layered-a", "layered-b"), "spine": ("spine-a", "spine-b")}
TARGETS = 4
BY_JOB = {"layered": 'job="layered"', "spine": 'job="spine"'}

NO_SHADOW = ParityStats(0, 0, missing="no shadow traffic in this test")


@dataclass
class Scene:
    prometheus: PrometheusServer
    endpoints: dict[str, MetricsEndpoint]
    windows: dict[str, WindowStats]  # the recorded scene's window, per side (default selectors)
    by_job: dict[str, WindowStats]   # the same window, sides told apart by the job label
    since: float
    until: float


def settled_window(prometheus: PrometheusServer) -> float:
    """A window start with one scrape of every target after it: what is recorded next
    lies between two samples of the window."""
    since = prometheus.wait_scraped(time.time(), TARGETS)
    prometheus.wait_scraped(since, TARGETS)
    return since


def window_end(prometheus: PrometheusServer) -> float:
    """The time of a round of scrapes of every target, the second one since the last thing
    recorded; ending the window there leaves any later (maybe failed) scrape out of it."""
    return prometheus.wait_scraped(prometheus.wait_scraped(time.time(), TARGETS), TARGETS)


@pytest.fixture(scope="module")
def scene(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scene]:
    layouts = {"layered-a": "layered", "layered-b": "layered", "spine-a": "collapsed", "spine-b": "mixed"}
    endpoints = {name: MetricsEndpoint(layout) for name, layout in layouts.items()}
    jobs = {job: [endpoints[name].address for name in names] for job, names in JOBS.items()}
    try:
        with run_prometheus(tmp_path_factory.mktemp("prometheus"), jobs) as prometheus:
            since = settled_window(prometheus)
            # layered: 89 requests on two pods, 4 of them failed by the layout, 5 refused, 80 OK
            # at ~0.15 ms; 100 shadow requests that must not count.
            endpoints["layered-a"].record(40, latency_s=0.00015)
            endpoints["layered-a"].record(2, "UNAVAILABLE", latency_s=0.00015)
            endpoints["layered-a"].record(5, "UNAUTHENTICATED", latency_s=0.00005)
            endpoints["layered-a"].record(100, "UNAVAILABLE", latency_s=0.00015, shadow=True)
            endpoints["layered-b"].record(40, latency_s=0.00015)
            endpoints["layered-b"].record(2, "UNAVAILABLE", latency_s=0.00015)
            # spine: 88 requests, 80 OK at ~0.6 ms, 8 failed slowly (2 s) by the layout.
            endpoints["spine-a"].record(40, latency_s=0.0006)
            endpoints["spine-b"].record(40, latency_s=0.0006)
            endpoints["spine-b"].record(8, "DEADLINE_EXCEEDED", latency_s=2.0)
            until = window_end(prometheus)
            by_layout, by_job = PrometheusSource(prometheus.url), PrometheusSource(prometheus.url, BY_JOB)
            yield Scene(prometheus, endpoints,
                        {side: by_layout.window(side, since, until) for side in JOBS},
                        {side: by_job.window(side, since, until) for side in JOBS}, since, until)
    finally:
        for endpoint in endpoints.values():
            endpoint.stop()


def test_a_window_sums_every_pod_of_a_side_and_leaves_shadow_traffic_out(scene: Scene) -> None:
    layered, spine = scene.windows["layered"], scene.windows["spine"]
    assert (layered.requests, layered.errors, layered.ok_requests) == (89, 4, 80)
    assert (spine.requests, spine.errors, spine.ok_requests) == (88, 8, 80)
    assert layered.error_rate == pytest.approx(4 / 89) and spine.error_rate == pytest.approx(8 / 88)
    assert not layered.missing and not spine.missing


def test_sides_can_be_told_apart_by_a_label_matcher_such_as_the_job(scene: Scene) -> None:
    assert scene.by_job == scene.windows


def test_the_p99_is_over_successful_requests_only(scene: Scene) -> None:
    """The spine's 8 failures took 2 s each (10% of its requests): counted in its error
    rate, never in its latency."""
    layered, spine = scene.windows["layered"], scene.windows["spine"]
    assert layered.p99_ms is not None and 0.1 <= layered.p99_ms <= 0.25    # the 0.1-0.25 ms bucket
    assert spine.p99_ms is not None and 0.5 <= spine.p99_ms <= 1.0          # the 0.5-1 ms bucket


def test_the_judges_samples_are_the_ok_buckets_at_their_midpoints(scene: Scene) -> None:
    """80 OK requests a side: the layered ones in the 0.1-0.25 ms bucket, the spine's in the
    0.5-1 ms one; the spine's slow failures are not latency samples."""
    layered, spine = scene.windows["layered"], scene.windows["spine"]
    assert {round(v, 6) for v in layered.latency_samples_ms} == {0.175}
    assert {round(v, 6) for v in spine.latency_samples_ms} == {0.75}
    assert 70 <= len(layered.latency_samples_ms) <= 90 and 70 <= len(spine.latency_samples_ms) <= 90


def test_the_judge_flags_the_spines_slower_bucket_and_not_its_error_rate(scene: Scene) -> None:
    judgement = judge_window(JudgeSpec(), scene.windows["layered"], scene.windows["spine"], NO_SHADOW)
    verdicts = {m.name: m for m in judgement.metrics}
    assert verdicts["latency"].verdict == "high" and verdicts["latency"].effect == pytest.approx(0.575)
    assert verdicts["error_rate"].verdict == "pass"  # 8 of 88 against 4 of 89: not beyond chance at 98 %
    assert (judgement.score, judgement.outcome) == (50.0, "fail")


def test_sub_millisecond_latencies_pass_the_ratio_gate_under_the_floor(scene: Scene) -> None:
    """Spine p99 ~1 ms against layered ~0.25 ms is a ratio of 4, and less than a millisecond."""
    [result] = evaluate([GateSpec("latency_p99_ratio", 2.0)], scene.windows["layered"], scene.windows["spine"],
                        NO_SHADOW, min_requests=20)
    assert result.value is not None and result.value > 2.0
    assert result.verdict is Verdict.PASS, result.message
    assert "min_delta_ms 5" in result.message
    [strict] = evaluate([GateSpec("latency_p99_ratio", 2.0, min_delta_ms=0.5)], scene.windows["layered"],
                        scene.windows["spine"], NO_SHADOW, min_requests=20)
    assert strict.verdict is Verdict.FAIL, strict.message


def test_the_error_rate_gate_judges_the_prometheus_window(scene: Scene) -> None:
    gates = [GateSpec("error_rate", 0.02), GateSpec("error_rate", 0.1)]
    tight, loose = evaluate(gates, scene.windows["layered"], scene.windows["spine"], NO_SHADOW, min_requests=20)
    assert tight.verdict is Verdict.FAIL and loose.verdict is Verdict.PASS  # delta 0.046


def test_a_side_without_series_is_no_data_and_every_gate_holds(scene: Scene) -> None:
    source = PrometheusSource(scene.prometheus.url, {"spine": 'job="nobody"'})
    spine = source.window("spine", scene.since, scene.until)
    assert spine.requests == 0 and 'job="nobody"' in spine.missing
    gates = [GateSpec("error_rate", 0.5), GateSpec("latency_p99_ratio", 100.0), GateSpec("parity", 0)]
    parity = source.parity(scene.since, scene.until)  # these endpoints mirror nothing
    assert parity.compared == 0 and "no spine_shadow_compared_total series" in parity.missing
    results = evaluate(gates, scene.windows["layered"], spine, parity, min_requests=0)
    assert [r.verdict for r in results] == [Verdict.INCONCLUSIVE] * 3
    assert window_verdict(results) is Verdict.INCONCLUSIVE


def test_an_unreachable_prometheus_is_no_data_not_a_pass(scene: Scene) -> None:
    source = PrometheusSource(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    stats = source.window("layered", scene.since, scene.until)
    assert stats.requests == 0 and "cannot query Prometheus" in stats.missing
    [result] = evaluate([GateSpec("error_rate", 0.5)], stats, scene.windows["spine"], NO_SHADOW, min_requests=0)
    assert result.verdict is Verdict.INCONCLUSIVE and "cannot query Prometheus" in result.message


def test_a_restarted_pod_counts_from_zero(scene: Scene) -> None:
    """spine-b restarts inside the window and counts 10 requests on fresh counters, under 48
    it had before: increase() takes the drop for a reset, so the window holds 10 (and
    spine-a's 15), neither a negative count nor the old 48 again."""
    prometheus, endpoints = scene.prometheus, scene.endpoints
    since = settled_window(prometheus)
    endpoints["spine-a"].record(15, latency_s=0.0006)
    endpoints["spine-b"].restart()
    endpoints["spine-b"].record(10, latency_s=0.0006)
    until = window_end(prometheus)
    spine = PrometheusSource(prometheus.url).window("spine", since, until)
    assert 25 <= spine.requests <= 25 * extrapolation_bound(until - since)
    assert spine.errors == 0 and spine.ok_requests == spine.requests


def extrapolation_bound(window_s: float) -> float:
    """How far increase() can stretch a window's count: from its first and last scrape inside
    the window (each at most one interval from an edge) to the window's edges."""
    return window_s / (window_s - 2 * 1.1 * SCRAPE_INTERVAL_S)


def test_the_queries_use_promql_for_resets_pods_and_missing_series() -> None:
    counts = requests_query('job="spine"', "10s")
    assert counts.startswith("sum by (status) (")
    assert 'increase(spine_requests_total{job="spine",shadow="false"}[10s])' in counts
    assert 'unless spine_requests_total{job="spine",shadow="false"} offset 10s' in counts
    p99 = p99_query('layout!="layered"', "10s")
    assert p99.startswith("histogram_quantile(0.99, sum by (le) (")
    assert 'spine_request_duration_seconds_bucket{layout!="layered",status="OK"}' in p99


@pytest.mark.parametrize("selector", ['job="spine"', ' layout!="layered" , pod=~"spine-.*"', 'a="x\\"y"'])
def test_a_side_selector_is_a_list_of_label_matchers(selector: str) -> None:
    assert check_selector(selector) == selector.strip()


@pytest.mark.parametrize("selector", ["", "job=spine", '{job="spine"}', 'job="spine") or vector(1', 'job="a",'])
def test_anything_else_is_refused_as_a_selector(selector: str) -> None:
    with pytest.raises(ValueError, match="label matchers"):
        check_selector(selector)


def test_a_prometheus_url_must_be_http(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="expected http://HOST:PORT"):
        PrometheusSource(str(tmp_path))
    with pytest.raises(ValueError, match="unknown side"):
        PrometheusSource("http://127.0.0.1:9090", {"canary": 'job="x"'})
