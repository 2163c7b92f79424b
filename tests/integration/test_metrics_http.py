"""The metrics endpoint: prometheus_client's exposition over HTTP, on loopback by default."""

from __future__ import annotations

import urllib.error
import urllib.request
from typing import Any

import pytest
import torch
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from monolith.device import DeviceContext
from runtime.config.file import load_config
from runtime.observability.metrics_endpoint import start_metrics_endpoint
from services.common.prometheus_http import PrometheusHTTPServer
from services.metrics.service import DEFAULT_BUCKETS, MetricsConfig, MetricsService
from tests.integration.test_metrics import parse_exposition, rec, record, sample
from wire.v1 import metrics_pb2


@pytest.fixture
def metrics() -> MetricsService:
    return MetricsService(MetricsConfig(), DeviceContext(device=torch.device("cpu")))


def scrape(address: str, path: str = "/metrics", accept: str | None = None) -> tuple[str, str]:
    """GET `path`; (Content-Type, body)."""
    request = urllib.request.Request(f"http://{address}{path}", headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=10) as resp:
        assert resp.status == 200
        return resp.headers["Content-Type"], resp.read().decode()


def test_http_endpoint_serves_the_exposition(metrics: MetricsService) -> None:
    record(metrics, [rec(latency_s=0.2)])
    with PrometheusHTTPServer(metrics.registry) as server:
        content_type, body = scrape(server.address)
        assert content_type.startswith("text/plain; version=0.0.4")
        assert body == metrics.render()
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://{server.address}/other", timeout=10)
        assert err.value.code == 404


def test_http_endpoint_refuses_a_non_loopback_address_by_default(metrics: MetricsService) -> None:
    with pytest.raises(ValueError, match="not a loopback address"):
        PrometheusHTTPServer(metrics.registry, "0.0.0.0:0")
    PrometheusHTTPServer(metrics.registry, "0.0.0.0:0", allow_external=True)  # allowed, not started


def test_render_is_prometheus_client_text_and_its_parser_reads_back_what_was_recorded(
    metrics: MetricsService,
) -> None:
    from prometheus_client.exposition import generate_latest

    record(metrics, [rec(latency_s=v, completion_tokens=3) for v in (0.0002, 0.004, 0.004, 12.0)])
    record(metrics, [rec(status="UNAVAILABLE", latency_s=0.3, shadow=True)])
    text = metrics.render()
    assert text == generate_latest(metrics.registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert {f.type for f in families.values()} == {"counter", "histogram"}
    requests = {(s.labels["status"], s.labels["shadow"]): s.value
                for s in families["spine_requests"].samples if s.name == "spine_requests_total"}
    assert requests == {("OK", "false"): 4, ("UNAVAILABLE", "true"): 1}
    tokens = [s.value for s in families["spine_tokens_generated"].samples]
    assert tokens == [12]
    who = {"layout": "collapsed", "model": "tiny-lm", "tenant": "dev", "status": "OK"}
    buckets = {s.labels["le"]: s.value for s in families["spine_request_duration_seconds"].samples
               if s.name.endswith("_bucket") and s.labels == {**who, "le": s.labels["le"]}}
    assert list(buckets) == [*(repr(b) for b in DEFAULT_BUCKETS), "+Inf"]
    assert buckets["0.0001"] == 0 and buckets["0.00025"] == 1 and buckets["0.0025"] == 1
    assert buckets["0.005"] == 3 and buckets["10.0"] == 3 and buckets["+Inf"] == 4
    summary = {s.name: s.value for s in families["spine_request_duration_seconds"].samples if s.labels == who}
    assert summary["spine_request_duration_seconds_count"] == 4
    assert summary["spine_request_duration_seconds_sum"] == pytest.approx(12.0082)
    # The migration gates read the same text.
    from migration.metrics.scrape import count, parse_series

    totals = count(parse_series(text))
    assert totals.requests == 4 and totals.ok_buckets[float("inf")] == 4


def test_http_endpoint_serves_openmetrics_when_asked(metrics: MetricsService) -> None:
    record(metrics, [rec(latency_s=0.003), rec(latency_s=0.03, failed_middlewares=["auth"])])
    with PrometheusHTTPServer(metrics.registry) as server:
        content_type, body = scrape(server.address, accept="application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert body.endswith("# EOF\n")
    families = {f.name: f for f in parse_openmetrics(body)}
    [failures] = families["spine_middleware_failures"].samples
    assert failures.labels == {"middleware": "auth"} and failures.value == 1
    who = {"layout": "collapsed", "model": "tiny-lm", "tenant": "dev", "status": "OK"}
    histogram = families["spine_request_duration_seconds"]
    assert histogram.type == "histogram"
    buckets = {s.labels["le"]: s.value for s in histogram.samples if s.name.endswith("_bucket")}
    assert buckets["0.0025"] == 0 and buckets["0.005"] == 1 and buckets["0.05"] == 2 and buckets["+Inf"] == 2
    assert {s.name: s.value for s in histogram.samples if s.labels == who}[
        "spine_request_duration_seconds_count"] == 2
    from migration.metrics.scrape import count, parse_series

    assert count(parse_series(body)).requests == 2


def test_http_endpoint_filters_by_name(metrics: MetricsService) -> None:
    record(metrics, [rec(latency_s=0.01)])
    with PrometheusHTTPServer(metrics.registry) as server:
        _, body = scrape(server.address, "/metrics?name[]=spine_requests_total")
    assert [f.name for f in text_string_to_metric_families(body)] == ["spine_requests"]


def test_a_scrape_runs_the_read_hooks_first(metrics: MetricsService) -> None:
    """Records handed over but not yet counted (the spine's completions window) are counted
    before every read: over HTTP, over gRPC and by render()."""
    pending = [rec(latency_s=0.01)]

    def drain() -> None:
        record(metrics, pending)
        pending.clear()

    metrics.read_hooks.add(drain)
    with PrometheusHTTPServer(metrics.registry) as server:
        _, body = scrape(server.address)
    who = {"layout": "collapsed", "model": "tiny-lm", "tenant": "dev", "status": "OK", "shadow": "false"}
    assert sample(parse_exposition(body), "spine_requests_total", **who) == 1
    pending.append(rec(latency_s=0.02))
    text = metrics.Scrape(metrics_pb2.ScrapeRequest(), context=None).text  # type: ignore[arg-type]
    assert sample(parse_exposition(text), "spine_requests_total", **who) == 2
    pending.append(rec(latency_s=0.03))
    assert sample(parse_exposition(metrics.render()), "spine_requests_total", **who) == 3


def test_a_failing_scrape_answers_500_and_the_endpoint_keeps_serving(metrics: MetricsService) -> None:
    broken = [True]

    def hook() -> None:
        if broken:
            raise RuntimeError("device lost")

    metrics.read_hooks.add(hook)
    with PrometheusHTTPServer(metrics.registry) as server:
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://{server.address}/metrics", timeout=10)
        assert err.value.code == 500 and b"device lost" in err.value.read()
        broken.clear()
        assert "# TYPE spine_requests_total counter" in scrape(server.address)[1]


def test_the_endpoint_writes_its_address_to_the_run_dir(metrics: MetricsService, tmp_path: Any) -> None:
    record(metrics, [rec(latency_s=0.01)])
    endpoint = start_metrics_endpoint(metrics, load_config(), tmp_path)
    try:
        address = (tmp_path / "metrics.addr").read_text()
        assert address == endpoint.address and address.startswith("127.0.0.1:")
        assert scrape(address)[1] == metrics.render()
    finally:
        endpoint.stop()
