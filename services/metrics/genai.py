"""The GenAI client metrics of OpenTelemetry's semantic conventions, from each request's record.

The gateway is the GenAI client: it calls the model for every request that is not refused
or answered from the cache, in every layout, and notes the call on the request's record
(`services.metrics.steps`). From those records, at `/metrics` beside the request families
(`services.common.genai_semconv` has the names, units, buckets and labels):

- `gen_ai_client_token_usage` (`{token}`): an answer's input and output tokens, one
  observation each (`gen_ai_token_type`); only where the model answered (the usage is known);
- `gen_ai_client_operation_duration_seconds`: the call, to the answer or a stream's last
  chunk; `error_type` is the gRPC status code's name of a call that ended in an error;
- `gen_ai_client_operation_time_to_first_chunk_seconds`: streams whose first chunk came.

Labelled by operation, provider, the routed model (`gen_ai_request_model`, the `model`
label of the request families) and the model that answered. Shadow copies are left out, as
from the latency families: a mirrored request would count its tokens twice.

Each bucket set is a device table of its own (`HistogramTable`), updated with the request
families under the metrics service's lock, one update per table per micro-batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from services.common import DeviceState
from services.common import genai_semconv as semconv
from services.metrics.histograms import HistogramSeries, HistogramTable, SeriesKey

FAMILIES = (semconv.CLIENT_TOKEN_USAGE, semconv.CLIENT_OPERATION_DURATION, semconv.CLIENT_TIME_TO_FIRST_CHUNK)
OPERATIONS = frozenset({"", semconv.CHAT, semconv.TEXT_COMPLETION})


def check_genai(record: Any) -> str | None:
    """Why a record's GenAI fields cannot be counted, or None."""
    if record.genai_operation not in OPERATIONS:
        return f"genai_operation: expected one of {', '.join(sorted(OPERATIONS - {''}))} or empty, " \
               f"got {record.genai_operation[:64]!r}"
    for name in ("genai_duration_s", "time_to_first_chunk_s"):
        value = getattr(record, name)
        if not math.isfinite(value) or value < 0:
            return f"{name}: expected a finite number >= 0, got {value!r}"
    if record.input_tokens < 0:
        return f"input_tokens: expected >= 0, got {record.input_tokens}"
    return None


class GenAiHistograms:
    """The three families' tables; not thread-safe (the metrics service holds its lock)."""

    def __init__(self, device: DeviceState, initial_rows: int) -> None:
        self.tokens = HistogramTable(device, semconv.TOKEN_BUCKETS, owner="metrics", initial_rows=initial_rows)
        self.durations = HistogramTable(device, semconv.DURATION_BUCKETS, owner="metrics", initial_rows=initial_rows)

    def observe(self, records: Sequence[Any]) -> None:
        """Every record of a model call (not a shadow copy's): one update per table."""
        token_keys: list[SeriesKey] = []
        tokens: list[float] = []
        duration_keys: list[SeriesKey] = []
        seconds: list[float] = []
        for r in records:
            if not r.genai_operation or r.shadow:
                continue
            model = (r.genai_operation, semconv.PROVIDER, r.model, r.response_model)
            ok = r.status == "OK"
            duration_keys.append((semconv.CLIENT_OPERATION_DURATION.family, *model, "" if ok else r.status))
            seconds.append(r.genai_duration_s)
            if r.time_to_first_chunk_s > 0:
                duration_keys.append((semconv.CLIENT_TIME_TO_FIRST_CHUNK.family, *model))
                seconds.append(r.time_to_first_chunk_s)
            if ok and r.response_model:  # an answer: its usage is known
                family = semconv.CLIENT_TOKEN_USAGE.family
                token_keys += [(family, *model, semconv.INPUT), (family, *model, semconv.OUTPUT)]
                tokens += [r.input_tokens, r.completion_tokens]
        if token_keys:
            self.tokens.observe(token_keys, tokens)
        if duration_keys:
            self.durations.observe(duration_keys, seconds)

    def snapshot(self) -> list[tuple[tuple[float, ...], list[HistogramSeries]]]:
        return [(self.tokens.bounds, self.tokens.snapshot()), (self.durations.bounds, self.durations.snapshot())]


class GenAiCollector(Collector):
    """The families at scrape time from one snapshot (every family exposed, even empty)."""

    def __init__(self, snapshot: Callable[[], list[tuple[tuple[float, ...], list[HistogramSeries]]]]) -> None:
        self._snapshot = snapshot

    def describe(self) -> Iterator[Metric]:
        yield from self._families().values()

    def collect(self) -> Iterator[Metric]:
        families = self._families()
        for bounds, series_list in self._snapshot():
            le = (*(floatToGoString(b) for b in bounds), "+Inf")
            for series in series_list:
                family = families[series.key[0]]
                assert isinstance(family, HistogramMetricFamily)
                family.add_metric(series.key[1:], list(zip(le, series.cumulative, strict=True)), series.sum)
        yield from families.values()

    @staticmethod
    def _families() -> dict[str, Metric]:
        return {m.family: HistogramMetricFamily(m.family, m.description, labels=m.labels, unit="") for m in FAMILIES}
