"""How `python -m migration.runner --target xds` picks the gates' metrics source from its flags."""

from __future__ import annotations

import re

import pytest

from migration.metrics.promql import PrometheusSource
from migration.metrics.scrape import ScrapeSource
from migration.runner import build_metrics_source, parse_args
from services.common import ConfigError
from tests.metrics_endpoints import MetricsEndpoint

BASE = ["--db", "x.db", "--listen", "unix:/tmp/x.sock", "--target", "xds"]


def source(*flags: str) -> object:
    return build_metrics_source(parse_args([*BASE, *flags]))


def test_a_prometheus_url_selects_promql_with_the_default_or_given_selectors() -> None:
    default = source("--prometheus-url", "http://127.0.0.1:9090")
    assert isinstance(default, PrometheusSource)
    assert default.selectors == {"layered": 'layout="layered"', "spine": 'layout!="layered"'}
    by_job = source("--prometheus-url", "http://127.0.0.1:9090", "--spine-selector", 'job="spine"')
    assert isinstance(by_job, PrometheusSource)
    assert by_job.selectors == {"layered": 'layout="layered"', "spine": 'job="spine"'}


def test_metrics_urls_are_repeatable_and_every_one_is_scraped() -> None:
    endpoints = [MetricsEndpoint("layered"), MetricsEndpoint("layered"), MetricsEndpoint("collapsed")]
    try:
        scrape = source("--layered-metrics", endpoints[0].url, "--layered-metrics", endpoints[1].url,
                        "--spine-metrics", endpoints[2].url)
        assert isinstance(scrape, ScrapeSource)
        try:
            assert scrape.endpoints("layered") == [endpoints[0].url, endpoints[1].url]
            assert scrape.endpoints("spine") == [endpoints[2].url]
        finally:
            scrape.close()
    finally:
        for endpoint in endpoints:
            endpoint.stop()


@pytest.mark.parametrize("flags, message", [
    ([], "needs --prometheus-url, or --layered-metrics and --spine-metrics"),
    (["--layered-metrics", "http://127.0.0.1:1/metrics"], "needs --prometheus-url, or --layered-metrics and"),
    (["--prometheus-url", "http://127.0.0.1:9090", "--spine-metrics", "http://127.0.0.1:1/metrics"],
     "exclude each other"),
    (["--spine-selector", 'job="spine"', "--layered-metrics", "http://a/metrics", "--spine-metrics", "http://b/metrics"],
     "need --prometheus-url"),
    (["--prometheus-url", "http://127.0.0.1:9090", "--spine-selector", "job=spine"], "expected PromQL label matchers"),
    (["--prometheus-url", "prometheus:9090"], "expected http://HOST:PORT"),
    (["--layered-metrics", "http://a/metrics", "--spine-metrics", "http://b/metrics", "--scrape-interval-s", "0"],
     "--scrape-interval-s: must be greater than 0"),
])
def test_a_wrong_combination_is_a_config_error_naming_the_flags(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        source(*flags)


def test_a_stage_waits_for_one_following_spine_replica_unless_told_otherwise() -> None:
    from migration.runner import build_xds_target

    assert parse_args(BASE).min_spine_replicas == 1
    args = parse_args([*BASE, "--xds-listen", "127.0.0.1:0", "--layered", "127.0.0.1:1", "--spine", "127.0.0.1:2",
                       "--prometheus-url", "http://127.0.0.1:9090", "--min-spine-replicas", "-1"])
    with pytest.raises(ConfigError, match=re.escape("--min-spine-replicas: must be >= 0, got -1")):
        build_xds_target(args)
