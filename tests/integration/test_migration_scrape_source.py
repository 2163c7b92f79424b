"""The local demo's source: a direct scrape of every endpoint of each side, summed and diffed.

Real /metrics endpoints (a MetricsService behind its HTTP server each, standing for one
process); scrapes are driven by hand (`interval_s=None`), so every count is exact, and where a
window's length matters the source's clock is one the test moves.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from migration.gates import ParityStats, Verdict, evaluate
from migration.metrics.scrape import ScrapeSource, count, increments, parse_series
from migration.metrics.source import histogram_quantile
from migration.plan import GateSpec
from runtime.shadow.metrics import ShadowCounters
from services.common.prometheus_http import PrometheusHTTPServer
from tests.metrics_endpoints import MetricsEndpoint
from tests.waiting import ManualClock, eventually

NO_SHADOW = ParityStats(0, 0, missing="no shadow traffic in this test")


@pytest.fixture
def endpoints() -> Iterator[dict[str, MetricsEndpoint]]:
    made = {"layered-a": MetricsEndpoint("layered"), "layered-b": MetricsEndpoint("layered"),
            "spine-a": MetricsEndpoint("collapsed"), "spine-b": MetricsEndpoint("collapsed")}
    yield made
    for endpoint in made.values():
        endpoint.stop()


def source_for(endpoints: dict[str, MetricsEndpoint]) -> ScrapeSource:
    return ScrapeSource({"layered": [endpoints["layered-a"].url, endpoints["layered-b"].url],
                         "spine": [endpoints["spine-a"].url, endpoints["spine-b"].url]}, interval_s=None)


def test_a_window_sums_every_endpoint_of_a_side(endpoints: dict[str, MetricsEndpoint]) -> None:
    endpoints["layered-a"].record(7)  # before the source looked: a baseline, not in any window
    source = source_for(endpoints)
    since = time.time()
    endpoints["layered-a"].record(30, latency_s=0.0002)
    endpoints["layered-a"].record(3, "UNAVAILABLE")
    endpoints["layered-a"].record(4, "INVALID_ARGUMENT", latency_s=0.00005)  # refused, not failed
    endpoints["layered-a"].record(50, "UNAVAILABLE", shadow=True)           # shadow: left out
    endpoints["layered-b"].record(20, latency_s=0.0002)
    endpoints["spine-b"].record(12, latency_s=0.0006)
    layered, spine = source.window("layered", since), source.window("spine", since)
    assert (layered.requests, layered.errors, layered.ok_requests) == (57, 3, 50)
    assert (spine.requests, spine.errors, spine.ok_requests) == (12, 0, 12)
    assert layered.p99_ms is not None and 0.1 < layered.p99_ms <= 0.25
    source.close()


def test_the_p99_is_over_successful_requests_only(endpoints: dict[str, MetricsEndpoint]) -> None:
    source = source_for(endpoints)
    since = time.time()
    endpoints["spine-a"].record(90, latency_s=0.0006)
    endpoints["spine-b"].record(10, "UNAVAILABLE", latency_s=3.0)
    spine = source.window("spine", since)
    assert spine.errors == 10 and spine.p99_ms is not None and 0.5 < spine.p99_ms <= 1.0
    # The judge's samples: the 90 OK requests at their bucket's midpoint (0.5-1 ms), not the failures.
    assert spine.latency_samples_ms == (pytest.approx(0.75),) * 90


def test_a_window_starts_at_the_last_scrape_before_it(endpoints: dict[str, MetricsEndpoint]) -> None:
    source = source_for(endpoints)
    endpoints["spine-a"].record(5)
    source.scrape("spine")
    since = time.time()
    endpoints["spine-a"].record(8)
    source.scrape("spine")
    endpoints["spine-b"].record(1)
    assert source.window("spine", since).requests == 9
    assert source.window("spine", 0.0).requests == 14  # from the oldest totals kept


def test_a_restarted_endpoint_counts_from_zero(endpoints: dict[str, MetricsEndpoint]) -> None:
    """spine-a had counted 40; restarted, it counts 6 on fresh counters. The window holds
    those 6 and spine-b's 5: never 6 - 40, never 40 again."""
    endpoints["spine-a"].record(40)
    source = source_for(endpoints)
    since = time.time()
    endpoints["spine-a"].restart()
    endpoints["spine-a"].record(6, latency_s=0.0006)
    endpoints["spine-b"].record(5, latency_s=0.0006)
    spine = source.window("spine", since)
    assert (spine.requests, spine.ok_requests) == (11, 11)
    assert spine.p99_ms is not None and 0.5 < spine.p99_ms <= 1.0


def test_an_endpoint_that_does_not_answer_leaves_the_others_counted(endpoints: dict[str, MetricsEndpoint]) -> None:
    source = source_for(endpoints)
    since = time.time()
    endpoints["layered-a"].record(10)
    endpoints["layered-b"].record(4)
    endpoints["layered-b"].stop()
    assert source.window("layered", since).requests == 10


def test_a_side_with_no_endpoint_answering_is_no_data(endpoints: dict[str, MetricsEndpoint]) -> None:
    source = source_for(endpoints)
    since = time.time()
    endpoints["layered-a"].record(30)
    endpoints["spine-a"].stop()
    endpoints["spine-b"].stop()
    spine = source.window("spine", since)
    assert spine.requests == 0 and "no spine endpoint answered" in spine.missing
    results = evaluate([GateSpec("error_rate", 1.0), GateSpec("latency_p99_ratio", 100.0)],
                       source.window("layered", since), spine, NO_SHADOW, min_requests=0)
    assert [r.verdict for r in results] == [Verdict.INCONCLUSIVE, Verdict.INCONCLUSIVE]


def test_the_background_thread_keeps_baselines_coming(endpoints: dict[str, MetricsEndpoint]) -> None:
    """Without a background scrape after the 3 requests, the last totals before `since` would
    be the source's first (none counted) and the window would hold all 5."""
    stamps: list[float] = []

    def clock() -> float:  # the wall clock, counting the scrapes that kept totals
        stamps.append(time.time())
        return stamps[-1]

    source = ScrapeSource({"layered": [endpoints["layered-a"].url], "spine": [endpoints["spine-a"].url]},
                          interval_s=0.05, clock=clock)
    try:
        endpoints["spine-a"].record(3)
        after_the_3 = len(stamps)
        eventually(lambda: len(stamps) >= after_the_3 + 4, what="two background scrapes of both sides")
        since = time.time()
        endpoints["spine-a"].record(2)
        assert source.window("spine", since).requests == 2
    finally:
        source.close()


def test_increments_count_a_new_series_from_zero_and_a_drop_as_a_restart() -> None:
    a, b = ("spine_requests_total", (("status", "OK"),)), ("spine_requests_total", (("status", "INTERNAL"),))
    assert increments(None, {a: 5.0}) == {}                          # first sight: a baseline
    assert increments({a: 5.0}, {a: 7.0, b: 2.0}) == {a: 2.0, b: 2.0}
    assert increments({a: 5.0, b: 2.0}, {a: 9.0, b: 1.0}) == {a: 9.0, b: 1.0}  # b went down: restarted
    assert increments({a: 5.0, b: 2.0}, {a: 9.0}) == {a: 9.0}        # b vanished: restarted


def test_the_exposition_is_read_with_prometheus_clients_parser() -> None:
    endpoint = MetricsEndpoint("layered")
    try:
        endpoint.record(98, latency_s=0.001)
        endpoint.record(1, "UNAVAILABLE", latency_s=0.2)
        endpoint.record(1, "INVALID_ARGUMENT", latency_s=0.0004)
        endpoint.record(1, "UNAVAILABLE", latency_s=5.0, shadow=True)
        counts = count(parse_series(endpoint.service.render()))
    finally:
        endpoint.stop()
    assert (counts.requests, counts.errors, counts.ok) == (100, 1, 98)  # shadow left out
    assert counts.ok_buckets[float("inf")] == 98                        # OK requests only


def test_histogram_quantile_interpolates_as_promql_does() -> None:
    buckets = {0.001: 0.0, 0.002: 50.0, 0.004: 100.0, float("inf"): 100.0}
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.00396)
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.002)
    assert histogram_quantile(0.99, {0.001: 0.0, float("inf"): 10.0}) == 0.001  # in +Inf: the top finite bound
    assert histogram_quantile(0.99, {0.001: 0.0, float("inf"): 0.0}) is None
    assert histogram_quantile(0.99, {0.001: 3.0}) is None                       # no +Inf bucket


def test_metrics_urls_must_be_http() -> None:
    with pytest.raises(ValueError, match="no /metrics URL for the spine side"):
        ScrapeSource({"layered": ["http://127.0.0.1:1/metrics"], "spine": []}, interval_s=None)
    with pytest.raises(ValueError, match="expected http://HOST:PORT/metrics"):
        ScrapeSource({"layered": ["file:///etc/passwd"], "spine": ["http://127.0.0.1:1/metrics"]}, interval_s=None)


def test_shadow_comparisons_are_read_by_field_with_calibrated_noise_left_out() -> None:
    """A mirror's counters (here served alone, as the built-in front serves them)."""
    counters = ShadowCounters()
    counters.expect([("spine", "layered")])
    with PrometheusHTTPServer(counters.registry) as http:
        source = ScrapeSource({"front": [f"http://{http.address}/metrics"]}, interval_s=None)
        assert source.shadow_exported().enabled
        since = time.time()
        counters.compared("spine", "layered", False, ["tokens"])
        counters.compared("spine", "layered", False, ["cached", "tokens"])
        counters.compared("layered", "spine", False, [])
        parity = source.parity(since)
        assert (parity.compared, parity.mismatches, dict(parity.by_field)) == (3, 3, {"tokens": 2, "cached": 1})
        # The spine disagreeing with itself excuses nothing (it is the one being judged)...
        counters.compared("spine", "spine", True, ["cached"])
        parity = source.parity(since)
        assert (parity.compared, parity.mismatches, parity.noisy_fields) == (3, 3, ())
        # ...the baseline disagreeing with itself on `cached` makes it noise, no longer counted.
        counters.compared("layered", "layered", True, ["cached"])
        parity = source.parity(since)
        assert (parity.compared, parity.mismatches, parity.noisy_fields) == (3, 2, ("cached",))


def test_noise_older_than_ten_windows_no_longer_excuses_a_field() -> None:
    counters = ShadowCounters()
    clock = ManualClock()
    with PrometheusHTTPServer(counters.registry) as http:
        source = ScrapeSource({"front": [f"http://{http.address}/metrics"]}, interval_s=None, clock=clock)
        counters.compared("layered", "layered", True, ["cached"])
        source.scrape("front")
        clock.advance(1.2)
        since = clock()
        counters.compared("spine", "layered", False, ["cached"])
        clock.advance(0.05)
        parity = source.parity(since)  # a 0.05 s window: noise over the last 0.5 s
        assert (parity.mismatches, parity.noisy_fields) == (1, ())
        assert source.parity(since - 1.5).noisy_fields == ("cached",)  # a longer window reaches the noise


def test_without_a_mirror_there_are_no_comparisons_to_read(endpoints: dict[str, MetricsEndpoint]) -> None:
    source = source_for(endpoints)
    capability = source.shadow_exported()
    assert not capability.enabled and "exports spine_shadow_compared_total" in capability.detail
    parity = source.parity(time.time() - 1)
    assert parity.compared == 0 and "nothing mirrors traffic" in parity.missing
