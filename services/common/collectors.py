"""Prometheus collectors read at scrape time: one made of several (a servicer exposes one
`store_collector`), and one made of a function that yields families built with `gauge`,
`counter` and `by_label`, so that a part's health on /metrics reads as one line per family."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector


class _Combined(Collector):
    def __init__(self, *collectors: Collector) -> None:
        self._collectors = collectors

    def collect(self) -> Iterator[Any]:
        for collector in self._collectors:
            yield from collector.collect()


def combined(*collectors: Collector | None) -> Collector | None:
    """The families of every collector given (None: none was)."""
    present = [c for c in collectors if c is not None]
    return None if not present else present[0] if len(present) == 1 else _Combined(*present)


class _ReadAtScrape(Collector):
    def __init__(self, families: Callable[[], Iterable[Metric]]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families()


def read_at_scrape(families: Callable[[], Iterable[Metric]]) -> Collector:
    """A collector whose families are `families()` at each scrape (the current values, with
    no metric object kept in step by the code that changes them)."""
    return _ReadAtScrape(families)


def gauge(name: str, documentation: str, value: float) -> Metric:
    return GaugeMetricFamily(name, documentation, value=float(value))


def counter(name: str, documentation: str, value: float) -> Metric:
    return CounterMetricFamily(name, documentation, value=float(value))


def by_label(kind: type[GaugeMetricFamily | CounterMetricFamily], name: str, documentation: str, label: str,
             values: Mapping[str, float]) -> Metric:
    """A gauge or counter family with one sample per `values` entry, its key as `label`."""
    family = kind(name, documentation, labels=[label])
    for key, value in values.items():
        family.add_metric([key], float(value))
    return family
