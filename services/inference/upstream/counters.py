"""What the upstreams did that an operator should see on /metrics, per upstream model.

`spine_upstream_streams_cut_total{model, reason}`: streams the spine ended itself because of
what the upstream sent. `reason="no_events"`: more bytes than the bound without one event
(blank lines, comments, garbage: `transports.SSEParser`), the client answered with an error
naming the upstream.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector


@dataclass
class EndpointCounters:
    """One upstream's counts (each changed on the upstream loop's thread only)."""

    no_events: int = 0


class UpstreamCollector(Collector):
    """The families above, for every (model id, counters) `endpoints()` gives at scrape time."""

    def __init__(self, endpoints: Callable[[], Iterable[tuple[str, EndpointCounters]]]) -> None:
        self._endpoints = endpoints

    def collect(self) -> Iterator[Metric]:
        cut = CounterMetricFamily("spine_upstream_streams_cut", "Streams the spine ended for what the upstream sent",
                                  labels=("model", "reason"))
        for model, counters in self._endpoints():
            cut.add_metric((model, "no_events"), counters.no_events)
        yield cut
