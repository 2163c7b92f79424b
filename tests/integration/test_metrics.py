"""Specification of the metrics service: counters, histograms, exposition, HTTP and gRPC."""

from __future__ import annotations

import re
import tempfile
from concurrent import futures
from typing import Any

import grpc
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from monolith.device import DeviceContext
from services.common import ConfigError
from services.metrics.histograms import CounterTable, HistogramTable
from services.metrics.service import DEFAULT_BUCKETS, MetricsConfig, MetricsService
from tests.batch_of_one import one
from wire.v1 import metrics_pb2, metrics_pb2_grpc

Rec = metrics_pb2.RequestRecord

# name{labels} value — label values may hold escaped quotes, backslashes and newlines.
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*"'
_SAMPLE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)"
    r"(?:\{(?P<labels>" + _LABEL + r"(?:," + _LABEL + r")*)?\})?"
    r" (?P<value>[-+]?(?:\d+(?:\.\d*)?(?:e[-+]?\d+)?|Inf|NaN))$"
)
_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\.)*)"')


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def parse_exposition(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """A strict little parser: every line is a comment or `name{labels} value`, else it fails."""
    assert text.endswith("\n")
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.match(r"^# (HELP|TYPE) [a-zA-Z_:][a-zA-Z0-9_:]* .+$", line), line
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        labels = frozenset((k, _unescape(v)) for k, v in _PAIR.findall(m.group("labels") or ""))
        key = (m.group("name"), labels)
        assert key not in samples, f"duplicate series {line!r}"
        samples[key] = float(m.group("value"))
    return samples


def sample(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


@pytest.fixture
def metrics() -> MetricsService:
    return MetricsService(MetricsConfig(), DeviceContext(device=torch.device("cpu")))


def record(service: MetricsService, records: list[metrics_pb2.RequestRecord]) -> None:
    """RecordBatch in-process; a refused record raises ValueError naming its index."""
    answer = service.RecordBatch(metrics_pb2.RecordBatchRequest(records=records))
    problems = [f"records[{i}].{status.message}" for i, status in enumerate(answer.results) if status.code]
    if problems:
        raise ValueError("; ".join(problems))


def rec(**kw: Any) -> metrics_pb2.RequestRecord:
    base: dict[str, Any] = {"layout": "collapsed", "model": "tiny-lm", "tenant": "dev", "status": "OK"}
    base.update(kw)
    return Rec(**base)


def test_record_counts_requests_by_layout_model_tenant_status(metrics: MetricsService) -> None:
    record(metrics, [rec(latency_s=0.01), rec(latency_s=0.02), rec(status="UNAVAILABLE", latency_s=0.3)])
    s = parse_exposition(metrics.render())
    common = {"layout": "collapsed", "model": "tiny-lm", "tenant": "dev", "shadow": "false"}
    assert sample(s, "spine_requests_total", status="OK", **common) == 2
    assert sample(s, "spine_requests_total", status="UNAVAILABLE", **common) == 1


def test_latency_lands_in_cumulative_le_buckets(metrics: MetricsService) -> None:
    # 0.001 sits exactly on a bound: `le` means it counts in that bucket.
    record(metrics, [rec(latency_s=v) for v in (0.00005, 0.001, 0.003, 20.0)])
    s = parse_exposition(metrics.render())
    labels = {"layout": "collapsed", "model": "tiny-lm", "tenant": "dev", "status": "OK"}

    def bucket(le: str) -> float:
        return sample(s, "spine_request_duration_seconds_bucket", le=le, **labels)

    assert bucket("0.0001") == 1
    assert bucket("0.0005") == 1
    assert bucket("0.001") == 2
    assert bucket("0.0025") == 2
    assert bucket("0.005") == 3
    assert bucket("10.0") == 3
    assert bucket("+Inf") == 4
    assert sample(s, "spine_request_duration_seconds_count", **labels) == 4
    assert sample(s, "spine_request_duration_seconds_sum", **labels) == pytest.approx(20.00405)


def test_buckets_span_a_tenth_of_a_millisecond_to_ten_seconds() -> None:
    assert DEFAULT_BUCKETS[0] == 0.0001
    assert DEFAULT_BUCKETS[-1] == 10.0
    assert list(DEFAULT_BUCKETS) == sorted(set(DEFAULT_BUCKETS))


def test_batch_update_equals_one_by_one() -> None:
    records = [
        rec(
            layout=("layered", "collapsed")[i % 2],
            tenant=f"t{i % 3}",
            status=("OK", "UNAVAILABLE", "DEADLINE_EXCEEDED")[i % 3],
            latency_s=(i * 0.0137) % 3.0,
            middleware_s={"auth": i * 1e-5, "cache": (i % 7) * 2e-4},
            cached=i % 4 == 0,
            shadow=i % 5 == 0,
            completion_tokens=i % 9,
            failed_middlewares=["logs"] if i % 11 == 0 else [],
        )
        for i in range(200)
    ]
    batched = MetricsService(MetricsConfig(initial_series=1), DeviceContext(device=torch.device("cpu")))
    single = MetricsService(MetricsConfig(), DeviceContext(device=torch.device("cpu")))
    record(batched, records)
    for r in records:
        one(single.RecordBatch(metrics_pb2.RecordBatchRequest(records=[r])))
    assert batched.render() == single.render()


def test_middleware_durations_and_cache_and_tokens_are_counted(metrics: MetricsService) -> None:
    record(metrics,
        [
            rec(
                latency_s=0.01,
                middleware_s={"auth": 0.0002, "cache": 0.002},
                cached=True,
                completion_tokens=7,
            ),
            rec(latency_s=0.01, middleware_s={"auth": 0.0003}, completion_tokens=5),
        ]
    )
    s = parse_exposition(metrics.render())
    who = {"layout": "collapsed", "model": "tiny-lm", "tenant": "dev", "shadow": "false"}
    assert sample(s, "spine_middleware_duration_seconds_count", layout="collapsed", middleware="auth") == 2
    assert sample(s, "spine_middleware_duration_seconds_count", layout="collapsed", middleware="cache") == 1
    assert (
        sample(
            s, "spine_middleware_duration_seconds_bucket", layout="collapsed", middleware="auth", le="0.00025"
        )
        == 1
    )
    assert sample(s, "spine_cache_hits_total", **who) == 1
    assert sample(s, "spine_tokens_generated_total", **who) == 12


def test_fail_open_middleware_failures_are_counted_per_middleware(metrics: MetricsService) -> None:
    record(metrics, [rec(failed_middlewares=["auth", "logs"]), rec(failed_middlewares=["logs"])])
    metrics.record_middleware_failure("auth")
    s = parse_exposition(metrics.render())
    assert sample(s, "spine_middleware_failures_total", middleware="auth") == 2
    assert sample(s, "spine_middleware_failures_total", middleware="logs") == 2


def test_shadow_records_are_counted_apart_and_kept_out_of_the_main_histogram(metrics: MetricsService) -> None:
    record(metrics,
        [
            rec(latency_s=0.01, middleware_s={"auth": 0.001}),
            rec(latency_s=5.0, shadow=True, middleware_s={"auth": 1.0}),
        ]
    )
    s = parse_exposition(metrics.render())
    base = {"layout": "collapsed", "model": "tiny-lm", "tenant": "dev", "status": "OK"}
    assert sample(s, "spine_requests_total", shadow="false", **base) == 1
    assert sample(s, "spine_requests_total", shadow="true", **base) == 1
    assert sample(s, "spine_request_duration_seconds_count", **base) == 1
    assert sample(s, "spine_request_duration_seconds_sum", **base) == pytest.approx(0.01)
    assert sample(s, "spine_shadow_request_duration_seconds_count", **base) == 1
    assert sample(s, "spine_shadow_request_duration_seconds_sum", **base) == pytest.approx(5.0)
    assert sample(s, "spine_middleware_duration_seconds_count", layout="collapsed", middleware="auth") == 1


def test_label_values_are_escaped(metrics: MetricsService) -> None:
    tenant = 'ev"il\\ten\nant'
    record(metrics, [rec(tenant=tenant, latency_s=0.1)])
    text = metrics.render()
    assert 'tenant="ev\\"il\\\\ten\\nant"' in text
    s = parse_exposition(text)
    assert (
        sample(
            s,
            "spine_requests_total",
            layout="collapsed",
            model="tiny-lm",
            tenant=tenant,
            status="OK",
            shadow="false",
        )
        == 1
    )


def test_exposition_has_help_and_type_and_sorted_series(metrics: MetricsService) -> None:
    record(metrics, [rec(tenant=t, latency_s=0.1) for t in ("zeta", "alpha", "mid")])
    text = metrics.render()
    parse_exposition(text)
    assert "# HELP spine_requests_total " in text
    assert "# TYPE spine_requests_total counter" in text
    assert "# TYPE spine_request_duration_seconds histogram" in text
    tenants = re.findall(r'^spine_requests_total\{[^}]*tenant="(\w+)"', text, flags=re.M)
    assert tenants == ["alpha", "mid", "zeta"]
    assert text == metrics.render()


def test_an_invalid_record_is_refused_alone_and_the_rest_of_its_batch_is_counted(metrics: MetricsService) -> None:
    with pytest.raises(ValueError, match=r"records\[1\]\.latency_s"):
        record(metrics, [rec(latency_s=0.1), rec(latency_s=float("nan"))])
    with pytest.raises(ValueError, match=r"middleware_s\['auth'\]"):
        record(metrics, [rec(middleware_s={"auth": -1.0})])
    samples = parse_exposition(metrics.render())
    assert sample(samples, "spine_requests_total", layout="collapsed", model="tiny-lm", tenant="dev",
                  status="OK", shadow="false") == 1


def test_tables_grow_by_doubling_and_keep_their_counts() -> None:
    device = DeviceContext(device=torch.device("cpu"))
    hist = HistogramTable(device, [1.0, 2.0], initial_rows=1)
    counters = CounterTable(device, initial_rows=1)
    for i in range(5):
        hist.observe([(f"s{i}",), ("s0",)], [0.5, 1.5])
        counters.add([(f"s{i}",), ("s0",)], [1, 2])
    snap = {s.key: s for s in hist.snapshot()}
    assert snap[("s0",)].cumulative == (1, 6, 6)
    assert snap[("s4",)].cumulative == (1, 1, 1)
    assert dict(counters.snapshot())[("s0",)] == 11
    # 5 series in 8 rows: counts 8x3 int64 + sums 8 float64 + counters 8 int64.
    assert device.usage()["metrics"] == 8 * 3 * 8 + 8 * 8 + 8 * 8


def test_series_past_the_device_budget_are_refused_without_corrupting_the_table() -> None:
    device = DeviceContext(device=torch.device("cpu"), budget_bytes=1024)
    hist = HistogramTable(device, [1.0], initial_rows=2)
    hist.observe([("a",), ("b",)], [0.5, 0.5])
    with pytest.raises(MemoryError):
        hist.observe([(f"n{i}",) for i in range(100)], [0.5] * 100)
    hist.observe([("a",)], [2.0])
    assert [(s.key, s.cumulative) for s in hist.snapshot()] == [(("a",), (1, 2)), (("b",), (1, 1))]


def test_config_from_dict_validates_fields() -> None:
    cfg = MetricsConfig.parse({"http_listen": "127.0.0.1:9464", "buckets": [0.1, 1]})
    assert cfg.buckets == (0.1, 1.0)
    assert MetricsConfig.parse(None) == MetricsConfig()
    with pytest.raises(ConfigError, match=r"metrics\.buckets\[1\]"):
        MetricsConfig.parse({"buckets": [1.0, 0.5]})
    with pytest.raises(ConfigError, match=r"metrics\.http_listen: '0\.0\.0\.0:9464' is not a loopback"):
        MetricsConfig.parse({"http_listen": "0.0.0.0:9464"})
    assert MetricsConfig.parse({"http_listen": "0.0.0.0:9464", "allow_external": True}).allow_external
    with pytest.raises(ConfigError, match=r"metrics\.http_listn: unknown key; known: http_listen"):
        MetricsConfig.parse({"http_listn": "127.0.0.1:1"})


def test_grpc_round_trip_on_a_unix_socket(metrics: MetricsService) -> None:
    with tempfile.TemporaryDirectory(prefix="spm") as tmp:
        address = f"unix:{tmp}/metrics.sock"
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        metrics_pb2_grpc.add_MetricsServicer_to_server(metrics, server)
        server.add_insecure_port(address)
        server.start()
        try:
            with grpc.insecure_channel(address) as channel:
                stub = metrics_pb2_grpc.MetricsStub(channel)
                one(stub.RecordBatch(metrics_pb2.RecordBatchRequest(records=[rec(latency_s=0.004,
                                                                                 failed_middlewares=["auth"])]),
                                     timeout=10))
                with pytest.raises(grpc.RpcError) as err:
                    one(stub.RecordBatch(metrics_pb2.RecordBatchRequest(records=[rec(latency_s=-1.0)]), timeout=10))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "latency_s" in (err.value.details() or "")
                text = stub.Scrape(metrics_pb2.ScrapeRequest(), timeout=10).text
        finally:
            server.stop(grace=None)
    s = parse_exposition(text)
    assert sample(s, "spine_middleware_failures_total", middleware="auth") == 1
    assert sample(
        s, "spine_request_duration_seconds_bucket",
        layout="collapsed", model="tiny-lm", tenant="dev", status="OK", le="0.005",
    ) == 1  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(batches=st.lists(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]),
                                           st.floats(min_value=0.0, max_value=20.0, allow_nan=False),
                                           st.integers(min_value=0, max_value=50)),
                                 max_size=12), max_size=6))
def test_host_updates_equal_the_torch_ops_bit_for_bit(batches: list[list[tuple[str, float, int]]]) -> None:
    """On the CPU the tables update numpy views of their tensors; CUDA takes the torch ops.
    Both must leave identical counts, sums (same additions, same order) and counters —
    values on bucket bounds included, where `le` decides."""
    bounds = [0.5, 1.0, 2.5, 10.0]
    tables = []
    for host in (True, False):
        device = DeviceContext(device=torch.device("cpu"))
        hist, counters = HistogramTable(device, bounds, initial_rows=1), CounterTable(device, initial_rows=1)
        hist.host_paths = counters.host_paths = host
        for batch in batches:
            edge = [(k, bounds[n % len(bounds)] if n % 3 == 0 else v, n) for k, v, n in batch]
            hist.observe([(k,) for k, _, _ in edge], [v for _, v, _ in edge])
            counters.add([(k,) for k, _, _ in edge], [n for _, _, n in edge])
        tables.append((hist.snapshot(), counters.snapshot()))
    assert tables[0] == tables[1]
