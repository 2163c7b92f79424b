"""The Metrics servicer: request counters and latency histograms in the Prometheus format.

Every series lives in one of two device tables (`services.metrics.histograms`): all counters in one
`CounterTable`, all histograms (which share their buckets) in one `HistogramTable`. So a
micro-batch of records is exactly two vectorized updates, whatever mix of families it touches.

Shadow (mirrored) requests are counted with `shadow="true"` and timed in their own histogram,
`spine_shadow_request_duration_seconds`, so they never skew the latency that the migration
gates compare; their per-middleware times are left out for the same reason.

The exposition is prometheus_client's: `TableCollector` turns one snapshot of both tables
into metric families at scrape time, on this service's own `CollectorRegistry`; `render()`
and `Scrape` return `generate_latest` of it, and the HTTP endpoint serves it as text or
OpenMetrics (`services.common.prometheus_http`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from services.common import (
    DeviceState,
    ReadHooks,
)
from services.metrics.api import RECORD_BATCH
from services.metrics.config import DEFAULT_BUCKETS as DEFAULT_BUCKETS
from services.metrics.config import MetricsConfig
from services.metrics.genai import GenAiCollector, GenAiHistograms, check_genai
from services.metrics.histograms import CounterTable, HistogramSeries, HistogramTable, SeriesKey
from services.pipeline.batch_rpc import ItemError
from services.pipeline.interface import NO_OPTIONS, CallOptions
from wire.v1 import metrics_pb2, metrics_pb2_grpc


@dataclass(frozen=True)
class Family:
    name: str
    kind: str  # "counter" or "histogram"
    help: str
    labels: tuple[str, ...]


REQUESTS = Family(
    "spine_requests_total", "counter", "Requests finished, by outcome.",
    ("layout", "model", "tenant", "status", "shadow"),
)  # fmt: skip
CACHE_HITS = Family(
    "spine_cache_hits_total", "counter", "Requests answered from the response cache.",
    ("layout", "model", "tenant", "shadow"),
)  # fmt: skip
PREGENERATED_HITS = Family(
    "spine_cache_pregenerated_hits_total", "counter",
    "Requests answered from the pre-generated table (cache.pregenerated); also in spine_cache_hits_total.",
    ("layout", "model", "tenant", "shadow"),
)  # fmt: skip
POLICY_VIOLATIONS = Family(
    "spine_output_policy_violations_total", "counter",
    "Answers ended by the output policy (content_policy_violation).", ("layout", "model", "tenant", "shadow"),
)  # fmt: skip
TOKENS = Family(
    "spine_tokens_generated_total", "counter", "Completion tokens generated.",
    ("layout", "model", "tenant", "shadow"),
)  # fmt: skip
FAILURES = Family(
    "spine_middleware_failures_total", "counter",
    "Middleware calls that failed and were let through (fail-open).", ("middleware",),
)  # fmt: skip
EJECTED = Family(
    "spine_middleware_ejected_total", "counter",
    "Requests that found a middleware ejected (failing fast after consecutive failures).", ("middleware",),
)  # fmt: skip
DURATION = Family(
    "spine_request_duration_seconds", "histogram", "End-to-end request latency (shadow traffic excluded).",
    ("layout", "model", "tenant", "status"),
)  # fmt: skip
SHADOW_DURATION = Family(
    "spine_shadow_request_duration_seconds", "histogram", "Latency of shadow (mirrored) requests.",
    ("layout", "model", "tenant", "status"),
)  # fmt: skip
MIDDLEWARE_DURATION = Family(
    "spine_middleware_duration_seconds", "histogram", "Time spent in each middleware (shadow excluded).",
    ("layout", "middleware"),
)  # fmt: skip

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (REQUESTS, CACHE_HITS, PREGENERATED_HITS, POLICY_VIOLATIONS, TOKENS, FAILURES, EJECTED, DURATION, SHADOW_DURATION, MIDDLEWARE_DURATION)
}

def check_record(record: metrics_pb2.RequestRecord) -> str | None:
    """Why `record` cannot be counted, or None: a bad latency would corrupt every later scrape."""
    if not math.isfinite(record.latency_s) or record.latency_s < 0:
        return f"latency_s: expected a finite number >= 0, got {record.latency_s!r}"
    for name, seconds in record.middleware_s.items():
        if not name:
            return "middleware_s: a middleware name is empty"
        if not math.isfinite(seconds) or seconds < 0:
            return f"middleware_s[{name!r}]: expected a finite number >= 0, got {seconds!r}"
    if record.completion_tokens < 0:
        return f"completion_tokens: expected >= 0, got {record.completion_tokens}"
    if any(not m for m in record.failed_middlewares):
        return "failed_middlewares: a middleware name is empty"
    if any(not m for m in record.ejected_middlewares):
        return "ejected_middlewares: a middleware name is empty"
    return check_genai(record)


@dataclass(frozen=True)
class _RequestKeys:
    """The series keys of one (layout, model, tenant, status, shadow) combination."""

    requests: SeriesKey
    cache_hits: SeriesKey
    pregenerated_hits: SeriesKey
    policy_violations: SeriesKey
    tokens: SeriesKey
    duration: SeriesKey


_KEY_MEMO_LIMIT = 4096


class MetricsService(metrics_pb2_grpc.MetricsServicer):
    """Counts and times requests; `record_batch` is the batcher's one update per micro-batch."""

    def __init__(self, config: MetricsConfig, device: DeviceState) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._keys: dict[tuple[str, str, str, str, bool], _RequestKeys] = {}
        # Run before every render: records handed over but not yet counted (the spine's
        # completions window) are counted first, so a scrape never misses one.
        self.read_hooks = ReadHooks()
        self._counters = CounterTable(device, owner="metrics", initial_rows=config.initial_series)
        self._histograms = HistogramTable(
            device, config.buckets, owner="metrics", initial_rows=config.initial_series
        )
        self._genai = GenAiHistograms(device, config.initial_series)  # the GenAI client families
        # What /metrics, Scrape and render() expose: this service's own registry (never the
        # process-global one), whose one collector reads the tables at scrape time.
        self.registry = CollectorRegistry()
        self.registry.register(TableCollector(self.snapshot, self._histograms.bounds))
        self.registry.register(GenAiCollector(self._genai_snapshot))

    # -- in-process API -------------------------------------------------------------------

    def _count(self, records: Sequence[metrics_pb2.RequestRecord]) -> None:
        """Count checked records with one counter update and one histogram update (MemoryError:
        no room for a new series, and nothing of the batch is counted)."""
        counter_keys: list[SeriesKey] = []
        amounts: list[int] = []
        hist_keys: list[SeriesKey] = []
        values: list[float] = []
        for r in records:
            layout, shadow = r.layout, r.shadow
            keys = self._request_keys(layout, r.model, r.tenant, r.status, shadow)
            counter_keys.append(keys.requests)
            amounts.append(1)
            if r.cached:
                counter_keys.append(keys.cache_hits)
                amounts.append(1)
            if r.pregenerated:
                counter_keys.append(keys.pregenerated_hits)
                amounts.append(1)
            if r.policy_violation:
                counter_keys.append(keys.policy_violations)
                amounts.append(1)
            if r.completion_tokens:
                counter_keys.append(keys.tokens)
                amounts.append(r.completion_tokens)
            for middleware in r.failed_middlewares:
                counter_keys.append((FAILURES.name, middleware))
                amounts.append(1)
            for middleware in r.ejected_middlewares:
                counter_keys.append((EJECTED.name, middleware))
                amounts.append(1)
            hist_keys.append(keys.duration)
            values.append(r.latency_s)
            if shadow:
                continue
            for middleware, seconds in sorted(r.middleware_s.items()):
                hist_keys.append((MIDDLEWARE_DURATION.name, layout, middleware))
                values.append(seconds)
        with self._lock:
            self._counters.add(counter_keys, amounts)
            self._histograms.observe(hist_keys, values)
            self._genai.observe(records)

    def _request_keys(self, layout: str, model: str, tenant: str, status: str, shadow: bool) -> _RequestKeys:
        """The series one request touches, built once per label combination (the same few
        combinations repeat on every request, and building tuples is most of the cost)."""
        label = (layout, model, tenant, status, shadow)
        keys = self._keys.get(label)
        if keys is None:
            flag = "true" if shadow else "false"
            who = (layout, model, tenant)
            keys = _RequestKeys(
                requests=(REQUESTS.name, *who, status, flag),
                cache_hits=(CACHE_HITS.name, *who, flag),
                pregenerated_hits=(PREGENERATED_HITS.name, *who, flag),
                policy_violations=(POLICY_VIOLATIONS.name, *who, flag),
                tokens=(TOKENS.name, *who, flag),
                duration=((SHADOW_DURATION if shadow else DURATION).name, *who, status),
            )
            if len(self._keys) < _KEY_MEMO_LIMIT:  # label values come from requests: stay bounded
                self._keys[label] = keys
        return keys

    def record_middleware_failure(self, middleware: str, count: int = 1) -> None:
        """Count a fail-open middleware failure outside of a request record."""
        if not middleware:
            raise ValueError("middleware: must not be empty")
        with self._lock:
            self._counters.add([(FAILURES.name, middleware)], [count])

    def render(self) -> str:
        """The whole exposition in the Prometheus text format 0.0.4, written by prometheus_client
        (`generate_latest` on this service's registry); families and series sorted."""
        return generate_latest(self.registry).decode("utf-8")

    def snapshot(self) -> tuple[list[tuple[SeriesKey, int]], list[HistogramSeries]]:
        """Every counter and histogram series, sorted by key, read in one go under the lock.
        The read hooks run first: records handed over but not yet counted (the spine's
        completions window) are counted before, so a scrape never misses one."""
        self.read_hooks.run()
        with self._lock:
            return self._counters.snapshot(), self._histograms.snapshot()

    def _genai_snapshot(self) -> list[tuple[tuple[float, ...], list[HistogramSeries]]]:
        """The GenAI families' tables, after the read hooks (as `snapshot`)."""
        self.read_hooks.run()
        with self._lock:
            return self._genai.snapshot()

    # -- gRPC -----------------------------------------------------------------------------

    def record(self, items: Sequence[Any], options: CallOptions = NO_OPTIONS) -> list[ItemError | None]:
        """Count every good record with one update; a bad record is refused alone (INVALID_ARGUMENT
        naming its field), so one corrupt record never costs the others their count. A record
        is a `MetricsRecord` or the `RequestRecord` it encodes to (the same fields)."""
        results: list[ItemError | None] = [None] * len(items)
        good: list[tuple[int, Any]] = []
        for index, record in enumerate(items):
            problem = check_record(record)
            if problem:
                results[index] = ItemError(grpc.StatusCode.INVALID_ARGUMENT, problem)
            else:
                good.append((index, record))
        try:
            self._count([record for _, record in good])
        except MemoryError:  # the table is full: count one by one, so only new series fail
            for index, record in good:
                try:
                    self._count([record])
                except MemoryError as exc:
                    results[index] = ItemError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                               f"metrics: no room for a new series: {exc}")
        return results

    def RecordBatch(self, request: metrics_pb2.RecordBatchRequest,
                    context: Any = None) -> metrics_pb2.RecordBatchResponse:
        """`record` over the wire."""
        return RECORD_BATCH.serve(self, request, context)

    def Scrape(
        self, request: metrics_pb2.ScrapeRequest, context: grpc.ServicerContext
    ) -> metrics_pb2.ScrapeResponse:
        return metrics_pb2.ScrapeResponse(text=self.render())


class TableCollector(Collector):
    """A prometheus_client collector over the device tables: `collect()` turns one snapshot
    into metric families at scrape time. Counting never goes through prometheus_client; the
    hot path stays one vectorized table update per micro-batch."""

    def __init__(
        self,
        snapshot: Callable[[], tuple[list[tuple[SeriesKey, int]], list[HistogramSeries]]],
        bounds: Sequence[float],
    ) -> None:
        self._snapshot = snapshot
        # The `le` label of each bucket, +Inf last, written as prometheus_client writes them.
        self._le = (*(floatToGoString(b) for b in bounds), "+Inf")

    def describe(self) -> Iterator[Metric]:
        """The families without samples: lets the registry know the names (`?name[]=` filters)."""
        yield from self._families().values()

    def collect(self) -> Iterator[Metric]:
        counters, histograms = self._snapshot()
        families = self._families()
        for key, value in counters:
            counter = families[key[0]]
            assert isinstance(counter, CounterMetricFamily)
            counter.add_metric(key[1:], value)
        for series in histograms:
            histogram = families[series.key[0]]
            assert isinstance(histogram, HistogramMetricFamily)
            histogram.add_metric(series.key[1:], list(zip(self._le, series.cumulative, strict=True)), series.sum)
        for name in sorted(families):
            yield families[name]

    @staticmethod
    def _families() -> dict[str, Metric]:
        """One empty family per entry of FAMILIES: every family is exposed, even before a sample."""
        kinds = {"counter": CounterMetricFamily, "histogram": HistogramMetricFamily}
        return {f.name: kinds[f.kind](f.name, f.help, labels=f.labels) for f in FAMILIES.values()}

