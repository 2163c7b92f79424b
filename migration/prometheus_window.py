"""Window stats for the gates, read from a side's Prometheus endpoint.

A controller that drives real data planes over xDS does not see the requests itself: each
side's own metrics (`spine_requests_total`, `spine_request_duration_seconds`) are what it
can read. Each scrape is a snapshot of counters; a window is the difference between the
newest snapshot and the last one taken at or before the window's start. Shadow traffic is
left out, as it is everywhere the gates look.
"""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from collections import deque
from dataclasses import dataclass, field

from migration.gates import WindowStats

# Codes that say the layout failed (as opposed to a request that was rightly refused).
LAYOUT_ERRORS = frozenset({"UNAVAILABLE", "INTERNAL", "UNKNOWN", "DEADLINE_EXCEEDED", "DATA_LOSS"})

_LINE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)$')
_LABEL = re.compile(r'(?P<key>[a-zA-Z_][a-zA-Z0-9_]*)="(?P<value>(?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Totals:
    """Cumulative counts at one scrape."""

    requests: float = 0.0
    errors: float = 0.0
    buckets: dict[float, float] = field(default_factory=dict)  # le (seconds) -> cumulative count


def parse_totals(text: str) -> Totals:
    """Sum the request counters and the latency histogram over every non-shadow series."""
    requests = errors = 0.0
    buckets: dict[float, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line.strip())
        if match is None:
            continue
        labels = {m["key"]: m["value"] for m in _LABEL.finditer(match["labels"] or "")}
        if labels.get("shadow") == "true":
            continue
        value = float(match["value"])
        if match["name"] == "spine_requests_total":
            requests += value
            if labels.get("status") in LAYOUT_ERRORS:
                errors += value
        elif match["name"] == "spine_request_duration_seconds_bucket" and "le" in labels:
            le = float("inf") if labels["le"] == "+Inf" else float(labels["le"])
            buckets[le] = buckets.get(le, 0.0) + value
    return Totals(requests, errors, buckets)


def p99_ms(buckets: dict[float, float]) -> float:
    """The upper bound of the bucket holding the 99th percentile, in ms (0 for no requests)."""
    ordered = sorted(buckets.items())
    total = ordered[-1][1] if ordered else 0.0
    if total <= 0:
        return 0.0
    for le, count in ordered:
        if count >= 0.99 * total:
            finite = le if le != float("inf") else max((b for b, _ in ordered if b != float("inf")), default=0.0)
            return finite * 1000.0
    return 0.0


class PrometheusWindow:
    """Scrapes one side's /metrics and answers window stats from the snapshots it kept."""

    def __init__(self, url: str, timeout_s: float = 2.0, keep: int = 4096) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self._snapshots: deque[tuple[float, Totals]] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def scrape(self, now: float | None = None) -> Totals:
        with urllib.request.urlopen(self.url, timeout=self.timeout_s) as reply:  # noqa: S310 - loopback/cluster URL
            totals = parse_totals(reply.read().decode())
        with self._lock:
            self._snapshots.append((time.time() if now is None else now, totals))
        return totals

    def window(self, since: float) -> WindowStats:
        """Requests, layout errors and p99 since `since` (a fresh scrape ends the window)."""
        latest = self.scrape()
        with self._lock:
            # The last snapshot at or before the window's start; failing that the oldest one
            # kept (a shorter window, never one that reaches back before we started looking).
            base = self._snapshots[0][1]
            for ts, totals in self._snapshots:
                if ts <= since:
                    base = totals
        buckets = {le: count - base.buckets.get(le, 0.0) for le, count in latest.buckets.items()}
        return WindowStats(int(latest.requests - base.requests), int(latest.errors - base.errors), p99_ms(buckets))
