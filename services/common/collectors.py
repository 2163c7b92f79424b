"""One Prometheus collector made of several (a servicer exposes one `store_collector`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

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
