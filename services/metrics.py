"""The Metrics servicer: request counters and latency histograms in the Prometheus format.

Every series lives in one of two device tables (`services.histograms`): all counters in one
`CounterTable`, all histograms (which share their buckets) in one `HistogramTable`. So a
micro-batch of records is exactly two vectorized updates, whatever mix of families it touches.

Shadow (mirrored) requests are counted with `shadow="true"` and timed in their own histogram,
`spine_shadow_request_duration_seconds`, so they never skew the latency that the migration
gates compare; their per-middleware times are left out for the same reason.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import grpc

from services.common import DeviceState, ReadHooks
from services.histograms import CounterTable, HistogramTable, SeriesKey
from services.sections import DEFAULT_BUCKETS as DEFAULT_BUCKETS
from services.sections import MetricsConfig
from spine.v1 import metrics_pb2, metrics_pb2_grpc


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
TOKENS = Family(
    "spine_tokens_generated_total", "counter", "Completion tokens generated.",
    ("layout", "model", "tenant", "shadow"),
)  # fmt: skip
FAILURES = Family(
    "spine_middleware_failures_total", "counter",
    "Middleware calls that failed and were let through (fail-open).", ("middleware",),
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
    for f in (REQUESTS, CACHE_HITS, TOKENS, FAILURES, DURATION, SHADOW_DURATION, MIDDLEWARE_DURATION)
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
    return None


@dataclass(frozen=True)
class _RequestKeys:
    """The series keys of one (layout, model, tenant, status, shadow) combination."""

    requests: SeriesKey
    cache_hits: SeriesKey
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

    # -- in-process API -------------------------------------------------------------------

    def record_batch(self, records: Sequence[metrics_pb2.RequestRecord]) -> None:
        """Count many records with one counter update and one histogram update.

        All or nothing: a bad record raises ValueError naming its index and field, and none of
        the batch is counted.
        """
        counter_keys: list[SeriesKey] = []
        amounts: list[int] = []
        hist_keys: list[SeriesKey] = []
        values: list[float] = []
        for i, r in enumerate(records):
            problem = check_record(r)
            if problem:
                raise ValueError(f"records[{i}].{problem}")
            layout, shadow = r.layout, r.shadow
            keys = self._request_keys(layout, r.model, r.tenant, r.status, shadow)
            counter_keys.append(keys.requests)
            amounts.append(1)
            if r.cached:
                counter_keys.append(keys.cache_hits)
                amounts.append(1)
            if r.completion_tokens:
                counter_keys.append(keys.tokens)
                amounts.append(r.completion_tokens)
            for middleware in r.failed_middlewares:
                counter_keys.append((FAILURES.name, middleware))
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
        """The whole exposition, Prometheus text format 0.0.4, families and series sorted."""
        self.read_hooks.run()
        with self._lock:
            counters = self._counters.snapshot()
            histograms = self._histograms.snapshot()
        by_family: dict[str, list[str]] = {name: [] for name in FAMILIES}
        for key, value in counters:
            family = FAMILIES[key[0]]
            by_family[family.name].append(f"{family.name}{format_labels(family.labels, key[1:])} {value}")
        bounds = [*(format_value(b) for b in self._histograms.bounds), "+Inf"]
        for series in histograms:
            family = FAMILIES[series.key[0]]
            names, label_values = family.labels, series.key[1:]
            lines = by_family[family.name]
            for le, count in zip(bounds, series.cumulative, strict=True):
                labels = format_labels((*names, "le"), (*label_values, le))
                lines.append(f"{family.name}_bucket{labels} {count}")
            lines.append(f"{family.name}_sum{format_labels(names, label_values)} {format_value(series.sum)}")
            lines.append(f"{family.name}_count{format_labels(names, label_values)} {series.count}")
        out: list[str] = []
        for name in sorted(FAMILIES):
            family = FAMILIES[name]
            out.append(f"# HELP {name} {escape_help(family.help)}")
            out.append(f"# TYPE {name} {family.kind}")
            out.extend(by_family[name])
        return "\n".join(out) + "\n"

    # -- gRPC -----------------------------------------------------------------------------

    def Record(
        self, request: metrics_pb2.RequestRecord, context: grpc.ServicerContext
    ) -> metrics_pb2.RecordResponse:
        try:
            self.record_batch([request])
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc).removeprefix("records[0]."))
        except MemoryError as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"metrics: no room for a new series: {exc}")
        return metrics_pb2.RecordResponse()

    def Scrape(
        self, request: metrics_pb2.ScrapeRequest, context: grpc.ServicerContext
    ) -> metrics_pb2.ScrapeResponse:
        return metrics_pb2.ScrapeResponse(text=self.render())


def escape_label_value(value: str) -> str:
    """Backslash, double quote and newline escaped, as the text format requires."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_labels(names: Iterable[str], values: Iterable[str]) -> str:
    pairs = ",".join(f'{n}="{escape_label_value(v)}"' for n, v in zip(names, values, strict=True))
    return "{" + pairs + "}" if pairs else ""


def format_value(value: float) -> str:
    """Go-style float text: integers keep a `.0`, infinities are `+Inf`/`-Inf`."""
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(float(value))
