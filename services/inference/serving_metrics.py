"""What the model server exports at /metrics: KV slots, queue, batch size, TTFT, ITL, device.

Families (every one labelled with the served `model` but the device's):

* `spine_kv_slots{model, state=used|free}` (gauge): KV cache slots, i.e. sequences running
  and room for more; `spine_kv_blocks{model, state=used|cached|free}` (gauge) where the
  cache is paged: blocks running sequences hold, blocks only the prefix cache holds (free
  on demand), free blocks;
* `spine_prefix_cache_lookups_total{model, result=hit|miss}` (counter): requests whose
  system prompt's blocks were already in the pool, or not;
* `spine_queue_depth{model, priority=latency|default|throughput}` (gauge): requests waiting
  for a slot, by priority class;
* `spine_batch_size{model}` (histogram): sequences per model step;
* `spine_ttft_seconds{model}` (histogram): from the request reaching the model server to
  its first token computed (queueing and prefill);
* `spine_itl_seconds{model}` (histogram): between two tokens of one sequence;
* `gen_ai_server_request_duration_seconds`, `gen_ai_server_time_to_first_token_seconds`,
  `gen_ai_server_time_per_output_token_seconds` (histograms): OpenTelemetry's GenAI server
  metrics, labelled as its conventions say (`services.inference.genai_metrics`);
* `spine_device_bytes{owner}` and `spine_device_budget_bytes` (gauges): the device
  context's budget and what each owner holds of it (in the spine: every collapsed
  middleware's tables and the KV pool; in the layered inference process: its own);
* on CUDA with `nvidia-ml-py` installed, dcgm-exporter's five golden metrics
  (`services.inference.gpu_metrics`).

The scheduler thread observes a step with one call (`ServingStats.step`): plain counts
under a lock, never prometheus_client objects on the decode path. `ServingCollector`
reads everything at scrape time. The inference servicer has a registry of its own
(`metrics_registry`); the runtime serves it, or registers the collector on the metrics
component's registry when both run in one process (`runtime.observability.serving_metrics_export`).
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from services.common import genai_semconv as semconv
from services.inference.priority import CLASS_NAMES

# The model server's GenAI families (`services.inference.genai_metrics`).
GENAI_FAMILIES = (semconv.SERVER_REQUEST_DURATION, semconv.SERVER_TIME_TO_FIRST_TOKEN,
                  semconv.SERVER_TIME_PER_OUTPUT_TOKEN)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Counts:
    """One histogram as plain counts (the caller holds the lock)."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # bucket `le` b counts values <= b
        self.sum += value

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative (le, count) pairs, +Inf last, as prometheus_client writes them."""
        total, out = 0, []
        for bound, count in zip((*(floatToGoString(b) for b in self.bounds), "+Inf"), self.counts, strict=True):
            total += count
            out.append((bound, float(total)))
        return out


class ServingStats:
    """Batch sizes, times to first token and between tokens of one served model."""

    def __init__(self, genai: Any = None) -> None:
        self._lock = threading.Lock()
        # The model's GenAI server families (`services.inference.genai_metrics.GenAiServerStats`).
        self.genai = genai
        self.batch = Counts(BATCH_BUCKETS)
        self.ttft = Counts(TTFT_BUCKETS)
        self.itl = Counts(ITL_BUCKETS)

    def step(self, batch: int, ttfts: Sequence[float], itls: Sequence[float]) -> None:
        """One model step of `batch` sequences: the first tokens and the next tokens it gave."""
        with self._lock:
            self.batch.observe(batch)
            for value in ttfts:
                self.ttft.observe(value)
            for value in itls:
                self.itl.observe(value)

    def snapshot(self) -> dict[str, tuple[list[tuple[str, float]], float]]:
        with self._lock:
            return {name: (counts.buckets(), counts.sum)
                    for name, counts in (("batch", self.batch), ("ttft", self.ttft), ("itl", self.itl))}


@dataclass(frozen=True)
class ModelGauges:
    """One served model's state at a scrape."""

    model: str
    slots_used: int
    slots_free: int
    queue: Mapping[int, int]  # waiting requests by priority class
    blocks: Mapping[str, int] | None  # paged caches: used, cached, free
    prefix_hits: int = 0
    prefix_misses: int = 0
    prefix_bytes: int | None = None  # slot pools: bytes of the shared prefixes stored (`kv_prefix`)


ModelsRead = Callable[[], Sequence[tuple[ModelGauges, ServingStats]]]

HISTOGRAMS = (("batch", "spine_batch_size", "Sequences per model step."),
              ("ttft", "spine_ttft_seconds", "Time from a request reaching the model server to its first token."),
              ("itl", "spine_itl_seconds", "Time between two tokens of one sequence."))


class ServingCollector(Collector):
    """The serving families at scrape time, for every model `models()` returns."""

    def __init__(self, models: ModelsRead, device: Any, gpu: Collector | None = None) -> None:
        self._models = models
        self._device = device
        self._gpu = gpu
        self._also: list[Collector] = []

    def describe(self) -> Iterator[Metric]:
        """The names without samples, so registries and `?name[]=` filters know them."""
        yield from self._families().values()

    def collect(self) -> Iterator[Metric]:
        families = self._families()
        for gauges, stats in self._models():
            model = gauges.model
            families["spine_kv_slots"].add_metric([model, "used"], gauges.slots_used)
            families["spine_kv_slots"].add_metric([model, "free"], gauges.slots_free)
            if gauges.blocks is not None:
                for state, count in gauges.blocks.items():
                    families["spine_kv_blocks"].add_metric([model, state], count)
            if gauges.prefix_bytes is not None:
                families["spine_prefix_cache_bytes"].add_metric([model], gauges.prefix_bytes)
            if gauges.blocks is not None or gauges.prefix_bytes is not None:
                families["spine_prefix_cache_lookups"].add_metric([model, "hit"], gauges.prefix_hits)
                families["spine_prefix_cache_lookups"].add_metric([model, "miss"], gauges.prefix_misses)
            for priority, name in CLASS_NAMES.items():
                families["spine_queue_depth"].add_metric([model, name], gauges.queue.get(priority, 0))
            snapshot = stats.snapshot()
            for key, name, _ in HISTOGRAMS:
                buckets, total = snapshot[key]
                histogram = families[name]
                assert isinstance(histogram, HistogramMetricFamily)
                histogram.add_metric([model], buckets, total)
        for _, stats in self._models():
            if stats.genai is not None:
                stats.genai.add_to(families)
        usage = getattr(self._device, "usage", None)
        if callable(usage):
            for owner, nbytes in sorted(usage().items()):
                families["spine_device_bytes"].add_metric([owner], nbytes)
        budget = getattr(self._device, "budget_bytes", None)
        if isinstance(budget, int):
            families["spine_device_budget_bytes"].add_metric([], budget)
        yield from families.values()
        if self._gpu is not None:
            yield from self._gpu.collect()
        for other in self._also:
            yield from other.collect()

    def also(self, collector: Collector) -> None:
        """Serve `collector`'s families with these (the upstream models' counts, say)."""
        self._also.append(collector)

    @staticmethod
    def _families() -> dict[str, Any]:
        families: dict[str, Any] = {
            "spine_kv_slots": GaugeMetricFamily("spine_kv_slots", "KV cache slots (sequences) by state.",
                                                labels=("model", "state")),
            "spine_kv_blocks": GaugeMetricFamily(
                "spine_kv_blocks", "KV cache blocks by state: used by running sequences, cached (unused "
                "shared prefixes, freed on demand), free.", labels=("model", "state")),
            "spine_prefix_cache_lookups": CounterMetricFamily(
                "spine_prefix_cache_lookups", "Requests whose system prompt's KV was kept, as blocks in the pool "
                "or as a stored copy (hit), or not (miss).", labels=("model", "result")),
            "spine_prefix_cache_bytes": GaugeMetricFamily(
                "spine_prefix_cache_bytes", "Bytes of shared prefixes a slot pool keeps apart (copied into each "
                "slot that reuses one).", labels=("model",)),
            "spine_queue_depth": GaugeMetricFamily("spine_queue_depth", "Requests waiting for a KV slot, by "
                                                   "priority class.", labels=("model", "priority")),
        }
        for _, name, help_text in HISTOGRAMS:
            families[name] = HistogramMetricFamily(name, help_text, labels=("model",))
        for metric in GENAI_FAMILIES:
            families[metric.family] = HistogramMetricFamily(metric.family, metric.description, labels=metric.labels)
        families["spine_device_bytes"] = GaugeMetricFamily(
            "spine_device_bytes", "Bytes of the device context's budget held, by owner.", labels=("owner",))
        families["spine_device_budget_bytes"] = GaugeMetricFamily(
            "spine_device_budget_bytes", "The device context's memory budget.")
        return families
