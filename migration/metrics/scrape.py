"""The local demo's metrics source: scrape every endpoint of each side, sum, diff.

Without a Prometheus server the controller does what one would, on a smaller scale: it
scrapes every `/metrics` endpoint of a side (each process or pod that serves part of it),
parses the exposition with prometheus_client's parser, and keeps, per side, running totals
of what every endpoint counted since the source first saw it. A window is the newest
totals minus the last totals kept at or before the window's start.

Counters are per process. An endpoint whose counters went down (or whose series vanished)
was restarted: everything it exposes now is counted from zero, as Prometheus' `increase()`
does. An endpoint's first scrape is only a baseline (its counts happened at unknown times);
a series that appears later on a known endpoint counts from zero.

The shadow comparisons (`spine_shadow_*`, for the parity gate) are read from every
endpoint of every group, whichever exports them: a spine that mirrors, or a group of its
own such as the built-in front's /metrics (`ScrapeSource({"front": [URL]})`).
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from migration.gates import ParityStats, WindowStats
from migration.judge.samples import bucket_samples_ms
from migration.metrics.parity import NOISE_WINDOWS, SHADOW_FAMILIES, ShadowCounts, add_sample, parity_stats
from migration.metrics.source import (
    DURATION_BUCKETS,
    LAYOUT_ERRORS,
    OK,
    REQUESTS,
    SIDES,
    check_side,
    histogram_quantile,
)
from migration.target import ShadowCapability
from runtime.shadow.metrics import COMPARED
from services.common import Clock

log = logging.getLogger("spine.migration.scrape")

SeriesKey = tuple[str, tuple[tuple[str, str], ...]]


@dataclass(frozen=True)
class Counts:
    """Request counts, the OK requests' cumulative latency buckets (le seconds -> count) and
    the shadow comparisons."""

    requests: float = 0.0
    errors: float = 0.0
    ok: float = 0.0
    ok_buckets: Mapping[float, float] = field(default_factory=dict)
    shadow: ShadowCounts = field(default_factory=ShadowCounts)

    def __add__(self, other: Counts) -> Counts:
        return Counts(self.requests + other.requests, self.errors + other.errors, self.ok + other.ok,
                      _combine(self.ok_buckets, other.ok_buckets, 1.0), self.shadow + other.shadow)

    def __sub__(self, other: Counts) -> Counts:
        return Counts(self.requests - other.requests, self.errors - other.errors, self.ok - other.ok,
                      _combine(self.ok_buckets, other.ok_buckets, -1.0), self.shadow - other.shadow)

    def stats(self) -> WindowStats:
        p99_s = histogram_quantile(0.99, self.ok_buckets) if self.ok else None
        p50_s = histogram_quantile(0.5, self.ok_buckets) if self.ok else None
        return WindowStats(round(self.requests), round(self.errors), None if p99_s is None else p99_s * 1000.0,
                           round(self.ok), p50_ms=None if p50_s is None else p50_s * 1000.0,
                           latency_samples_ms=bucket_samples_ms(self.ok_buckets) if self.ok else ())


def _combine(a: Mapping[float, float], b: Mapping[float, float], sign: float) -> dict[float, float]:
    return {le: a.get(le, 0.0) + sign * b.get(le, 0.0) for le in a.keys() | b.keys()}


def parse_series(text: str) -> dict[SeriesKey, float]:
    """The samples the gates read, by series: request counters, the latency buckets and the
    shadow comparisons."""
    series = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (REQUESTS, DURATION_BUCKETS, *SHADOW_FAMILIES):
                series[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return series


def count(series: Mapping[SeriesKey, float]) -> Counts:
    """Sum series into Counts: shadow requests left out, latency of OK requests only."""
    requests = errors = ok = 0.0
    buckets: dict[float, float] = {}
    shadow = ShadowCounts()
    for (name, pairs), value in series.items():
        labels = dict(pairs)
        if name == REQUESTS:
            if labels.get("shadow") == "true":
                continue
            requests += value
            status = labels.get("status", "")
            errors += value if status in LAYOUT_ERRORS else 0.0
            ok += value if status == OK else 0.0
        elif name == DURATION_BUCKETS and labels.get("status") == OK and "le" in labels:
            le = float(labels["le"])
            buckets[le] = buckets.get(le, 0.0) + value
        else:
            shadow = add_sample(shadow, name, labels, value)
    return Counts(requests, errors, ok, buckets, shadow)


def increments(previous: Mapping[SeriesKey, float] | None,
               current: Mapping[SeriesKey, float]) -> dict[SeriesKey, float]:
    """What an endpoint counted between two scrapes (None before: a baseline, nothing counted).

    A series that went down or vanished means the process restarted: every series then
    counts from zero, so the increment is its whole current value."""
    if previous is None:
        return {}
    restarted = any(key not in current or current[key] < value for key, value in previous.items())
    if restarted:
        return dict(current)
    return {key: value - previous.get(key, 0.0) for key, value in current.items()}


class _Group:
    """The endpoints of one side (or of a group such as the front's): totals and their history."""

    def __init__(self, urls: Sequence[str], keep: int) -> None:
        self.urls = list(urls)
        self.last: dict[str, dict[SeriesKey, float] | None] = dict.fromkeys(self.urls)
        self.total = Counts()
        self.snapshots: deque[tuple[float, Counts]] = deque(maxlen=keep)
        self.lock = threading.Lock()  # one scrape of a group at a time: snapshots stay in order

    def since(self, since: float) -> Counts:
        """What was counted since `since`: the newest totals less the last ones kept at or
        before it; failing that the oldest (a shorter window, never one that reaches back
        before the source started)."""
        with self.lock:
            if not self.snapshots:
                return Counts()
            latest = self.snapshots[-1][1]
            base = self.snapshots[0][1]
            for ts, totals in self.snapshots:
                if ts > since:
                    break
                base = totals
        return latest - base

    def exporting_shadow(self) -> list[str]:
        """The endpoints whose last scrape held shadow comparison counters."""
        with self.lock:
            return [url for url, series in self.last.items()
                    if series is not None and any(name == COMPARED for name, _ in series)]


class ScrapeSource:
    """Scrapes every endpoint of both sides, every `interval_s` in the background.

    `endpoints` maps each side to its URLs; a source that only reads shadow comparisons
    (the built-in front's) has one group of another name instead, e.g. {"front": [URL]}:
    any group given must list at least one URL. `interval_s=None`: no background thread;
    `scrape(group)` (and every `window` and `parity`) scrapes. `clock` stamps each scrape and
    ends each parity window: the wall clock the callers' `since` is read from (a test moves its
    own instead of waiting)."""

    def __init__(self, endpoints: Mapping[str, Sequence[str]], interval_s: float | None = 0.5,
                 timeout_s: float = 2.0, keep: int = 4096, clock: Clock = time.time) -> None:
        if not endpoints:
            raise ValueError("ScrapeSource: no endpoints to scrape")
        for side, urls in endpoints.items():
            if not urls:
                what = f"the {side} side" if side in SIDES else f"group {side!r}"
                raise ValueError(f"ScrapeSource: no /metrics URL for {what}")
            for url in urls:
                if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
                    raise ValueError(f"{side} metrics URL {url!r}: expected http://HOST:PORT/metrics")
        self.timeout_s = timeout_s
        self._clock = clock
        self._sides = {side: _Group(urls, keep) for side, urls in endpoints.items()}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        for side in self._sides:
            failures = self.scrape(side)  # the baseline
            if failures:
                log.warning("cannot scrape %s yet: %s", side, "; ".join(failures))
        if interval_s is not None:
            self._thread = threading.Thread(target=self._loop, args=(interval_s,), name="metrics-scrape",
                                            daemon=True)
            self._thread.start()

    def endpoints(self, side: str) -> list[str]:
        return list(self._sides[side].urls) if side in self._sides else []

    def scrape(self, side: str) -> list[str]:
        """Scrape every endpoint of `side` (a group) once and keep the new totals; the failures, one line each."""
        state = self._sides[side]
        failures = []
        with state.lock:
            added = Counts()
            reached = 0
            for url in state.urls:
                try:
                    with urllib.request.urlopen(url, timeout=self.timeout_s) as reply:  # noqa: S310 - operator's URL
                        current = parse_series(reply.read().decode())
                except (OSError, ValueError) as error:  # unreachable, HTTP error, unparsable text
                    failures.append(f"{url}: {error}")
                    continue
                reached += 1
                added = added + count(increments(state.last[url], current))
                state.last[url] = current
            if reached:
                state.total = state.total + added
                state.snapshots.append((self._clock(), state.total))
        return failures

    def window(self, side: str, since: float) -> WindowStats:
        """Requests, layout errors and the OK requests' p99 since `since` (a fresh scrape ends it)."""
        check_side(side)
        if side not in self._sides:
            return WindowStats(0, 0, None, 0, missing=f"no {side} endpoint to scrape was given")
        failures = self.scrape(side)
        state = self._sides[side]
        if len(failures) == len(state.urls):
            return WindowStats(0, 0, None, 0, missing=f"no {side} endpoint answered: {'; '.join(failures)}")
        if failures:
            log.warning("window of %s without %d of %d endpoints: %s", side, len(failures), len(state.urls),
                        "; ".join(failures))
        return state.since(since).stats()

    def parity(self, since: float) -> ParityStats:
        """The shadow comparisons since `since` from every endpoint that exports them (a
        fresh scrape ends the window); noise over `NOISE_WINDOWS` windows."""
        now = self._clock()
        reached = False
        for name, state in self._sides.items():
            failures = self.scrape(name)
            reached = reached or len(failures) < len(state.urls)
        if not reached:
            return ParityStats(0, 0, missing="no endpoint answered")
        if not any(state.exporting_shadow() for state in self._sides.values()):
            return ParityStats(0, 0, missing=f"no endpoint exports {COMPARED} (nothing mirrors traffic)")
        noise_since = now - NOISE_WINDOWS * max(now - since, 0.0)
        window = sum((state.since(since).shadow for state in self._sides.values()), ShadowCounts())
        noise = sum((state.since(noise_since).shadow for state in self._sides.values()), ShadowCounts())
        return parity_stats(window, noise.noise)

    def shadow_exported(self) -> ShadowCapability:
        """Scrapes every endpoint now: enabled when one of them exports the shadow counters."""
        failures = [failure for name in self._sides for failure in self.scrape(name)]
        exporting = [url for state in self._sides.values() for url in state.exporting_shadow()]
        if exporting:
            return ShadowCapability(True, f"{', '.join(exporting)} export {COMPARED}")
        urls = [url for state in self._sides.values() for url in state.urls]
        unreachable = f" ({'; '.join(failures)})" if failures else ""
        return ShadowCapability(False, (
            f"none of {', '.join(urls)} exports {COMPARED}{unreachable}: no spine mirrors traffic (give the "
            f"spine's config shadow.share > 0 and shadow.layered_address, and both sides the internal secret)"))

    def _loop(self, interval_s: float) -> None:
        """Keep totals coming, so every window has a baseline near its start."""
        while not self._stop.wait(interval_s):
            for side in self._sides:
                failures = self.scrape(side)
                if failures:
                    log.warning("cannot scrape %s: %s", side, "; ".join(failures))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
