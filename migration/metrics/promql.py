"""The production metrics source: PromQL against a Prometheus server's HTTP API.

Prometheus scrapes every pod of both sides; the controller asks it, per side and window,

    sum by (status) (W(spine_requests_total{SIDE, shadow="false"}))
    histogram_quantile(0.99, sum by (le) (W(spine_request_duration_seconds_bucket{SIDE, status="OK"})))

where W(s) is each series' increase over the window:

    (increase(s[R]) and s offset R) or (s unless s offset R)

`increase()` handles counter resets (a restarted pod) per series, and `sum` adds the pods
up after it, never before. The second half counts a series born inside the window (a pod
that started, the first error of a kind) from zero: `increase()` alone drops its first
value. `SIDE` is a label matcher list: by default the `layout` label every series carries
(`layout="layered"` against the rest), or `job="spine"` and such where the sides are told
apart by how Prometheus scrapes them.

No series at all for a side, or a query that fails, is no data: the stats say why in
`missing` and every gate holds. `increase()` needs two samples of a series inside the
window, so a window should span at least two (better four) scrape intervals.

The parity gate's shadow comparisons come from whoever mirrors (the spines, each pod its
own series), whichever side Prometheus scrapes them under:

    sum by (calibration) (W(spine_shadow_compared_total))
    sum by (field) (W(spine_shadow_mismatched_total{calibration="false"}))
    sum by (field) (W'(spine_shadow_mismatched_total{calibration="true"}))

W' is W over `NOISE_WINDOWS` windows: the fields a layout disagreed with itself on lately
(`migration.metrics.parity`). No `spine_shadow_compared_total` series is no data.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from migration.gates import ParityStats, WindowStats
from migration.judge.samples import bucket_samples_ms
from migration.metrics.parity import BASELINE, NOISE_WINDOWS, ShadowCounts, parity_stats
from migration.metrics.source import DURATION_BUCKETS, OK, REQUESTS, SIDES, check_side, stats_by_status
from migration.target import ShadowCapability
from runtime.shadow.metrics import COMPARED, MISMATCHED

log = logging.getLogger("spine.migration.promql")

DEFAULT_SELECTORS: dict[str, str] = {"layered": 'layout="layered"', "spine": 'layout!="layered"'}
_MATCHER = r'\s*[A-Za-z_][A-Za-z0-9_]*\s*(?:=~|!~|!=|=)\s*"(?:[^"\\]|\\.)*"\s*'
_SELECTOR = re.compile(rf"{_MATCHER}(?:,{_MATCHER})*")


class PrometheusError(Exception):
    """A query Prometheus did not answer with a result."""


def check_selector(selector: str, what: str = "selector") -> str:
    """`selector` stripped, if it is a list of PromQL label matchers; ValueError naming it otherwise."""
    if not _SELECTOR.fullmatch(selector):
        raise ValueError(f'{what} {selector!r}: expected PromQL label matchers such as job="spine" or '
                         f'layout!="layered", separated by commas')
    return selector.strip()


def window_increase(selector: str, range_: str) -> str:
    """Each series' increase over the last `range_`, reset-safe; a series born inside it counts from zero."""
    return f"(increase({selector}[{range_}]) and {selector} offset {range_}) or ({selector} unless {selector} offset {range_})"


def requests_query(side_selector: str, range_: str) -> str:
    series = f'{REQUESTS}{{{side_selector},shadow="false"}}'
    return f"sum by (status) ({window_increase(series, range_)})"


def p99_query(side_selector: str, range_: str) -> str:
    series = f'{DURATION_BUCKETS}{{{side_selector},status="{OK}"}}'
    return f"histogram_quantile(0.99, sum by (le) ({window_increase(series, range_)}))"


def buckets_query(side_selector: str, range_: str) -> str:
    """The OK requests' latency buckets counted in the window: the judge's samples."""
    series = f'{DURATION_BUCKETS}{{{side_selector},status="{OK}"}}'
    return f"sum by (le) ({window_increase(series, range_)})"


def series(name: str, *matchers: str) -> str:
    """`name{m1,m2}` from the non-empty matchers, or just `name`."""
    given = ",".join(m for m in matchers if m)
    return f"{name}{{{given}}}" if given else name


def compared_query(selector: str, range_: str) -> str:
    return f"sum by (calibration) ({window_increase(series(COMPARED, selector), range_)})"


def mismatched_query(selector: str, range_: str, calibration: bool) -> str:
    # Calibration: the baseline's own disagreements only (`parity.BASELINE`: why).
    flag = f'calibration="true",primary="{BASELINE}"' if calibration else 'calibration="false"'
    return f"sum by (field) ({window_increase(series(MISMATCHED, selector, flag), range_)})"


def _range(seconds: float) -> str:
    return f"{max(1, round(seconds * 1000))}ms"


class PrometheusSource:
    """Window stats from a Prometheus server at `url` (e.g. http://prometheus:9090).

    `shadow_selector`: label matchers picking the shadow comparison series (default: all
    of them — only mirrors export them)."""

    def __init__(self, url: str, selectors: Mapping[str, str] | None = None, timeout_s: float = 5.0,
                 shadow_selector: str = "") -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"Prometheus URL {url!r}: expected http://HOST:PORT")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        given = dict(selectors or {})
        unknown = set(given) - set(SIDES)
        if unknown:
            raise ValueError(f"selectors: unknown side(s) {', '.join(sorted(unknown))}; expected {', '.join(SIDES)}")
        self.selectors = {side: check_selector(given.get(side) or DEFAULT_SELECTORS[side], f"{side} selector")
                          for side in SIDES}
        self.shadow_selector = check_selector(shadow_selector, "shadow selector") if shadow_selector else ""

    def window(self, side: str, since: float, until: float | None = None) -> WindowStats:
        """`side`'s requests in (since, until], until defaulting to now."""
        check_side(side)
        until = time.time() if until is None else until
        range_ = _range(until - since)
        selector = self.selectors[side]
        try:
            counts = self.query(requests_query(selector, range_), until)
            p99 = self.query(p99_query(selector, range_), until)
            buckets = self.query(buckets_query(selector, range_), until)
        except PrometheusError as error:
            log.warning("window of %s: %s", side, error)
            return WindowStats(0, 0, None, 0, missing=str(error))
        if not counts:
            return WindowStats(0, 0, None, 0, missing=(
                f"Prometheus has no {REQUESTS}{{{selector}}} series with two samples in the last {range_} "
                f"(nothing scraped for this side, or a window shorter than two scrape intervals)"))
        by_status = {sample["metric"].get("status", ""): _value(sample) for sample in counts}
        p99_s = _value(p99[0]) if p99 else None
        stats = stats_by_status(by_status, p99_s)
        cumulative = {float(sample["metric"].get("le", "nan")): _value(sample) for sample in buckets}
        return replace(stats, latency_samples_ms=bucket_samples_ms(
            {le: n for le, n in cumulative.items() if not (math.isnan(le) or math.isnan(n))}) if stats.successes else ())

    def parity(self, since: float, until: float | None = None) -> ParityStats:
        """The shadow comparisons in (since, until]; noise over `NOISE_WINDOWS` windows."""
        until = time.time() if until is None else until
        length = until - since
        range_, noise_range = _range(length), _range(length * NOISE_WINDOWS)
        try:
            compared = self.query(compared_query(self.shadow_selector, range_), until)
            mismatched = self.query(mismatched_query(self.shadow_selector, range_, calibration=False), until)
            noise = self.query(mismatched_query(self.shadow_selector, noise_range, calibration=True), until)
        except PrometheusError as error:
            log.warning("shadow comparisons: %s", error)
            return ParityStats(0, 0, missing=str(error))
        if not compared:
            return ParityStats(0, 0, missing=(
                f"Prometheus has no {series(COMPARED, self.shadow_selector)} series with two samples in the last "
                f"{range_} (nothing mirrors traffic, or a window shorter than two scrape intervals)"))
        by_calibration = {sample["metric"].get("calibration", ""): _value(sample) for sample in compared}
        window = ShadowCounts(compared=_finite(by_calibration.get("false", 0.0)),
                              calibration_compared=_finite(by_calibration.get("true", 0.0)),
                              mismatched={s["metric"].get("field", ""): _finite(_value(s)) for s in mismatched})
        return parity_stats(window, {s["metric"].get("field", ""): _finite(_value(s)) for s in noise})

    def shadow_exported(self) -> ShadowCapability:
        wanted = series(COMPARED, self.shadow_selector)
        try:
            found = self.query(f"count({wanted})", time.time())
        except PrometheusError as error:
            return ShadowCapability(False, f"cannot ask for shadow comparisons: {error}")
        if not found:
            return ShadowCapability(False, (
                f"Prometheus at {self.url} has no {wanted} series: nothing it scrapes mirrors traffic (give the "
                f"spine's config shadow.share > 0 and shadow.layered_address, and both sides the internal secret, "
                f"and have Prometheus scrape the spine's /metrics)"))
        return ShadowCapability(True, f"Prometheus at {self.url} has {_value(found[0]):.0f} {wanted} series")

    def query(self, promql: str, at: float) -> list[dict[str, Any]]:
        """An instant query's vector at time `at`; PrometheusError when there is none."""
        params = urllib.parse.urlencode({"query": promql, "time": f"{at:.3f}"})
        url = f"{self.url}/api/v1/query?{params}"
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as reply:  # noqa: S310 - operator's URL
                body = json.loads(reply.read())
        except urllib.error.HTTPError as error:  # Prometheus explains a bad query in the body
            body = _json_or_none(error)
            if body is None:
                raise PrometheusError(f"Prometheus at {self.url} answered HTTP {error.code}") from None
        except (OSError, ValueError) as error:
            raise PrometheusError(f"cannot query Prometheus at {self.url}: {error}") from None
        if body.get("status") != "success":
            raise PrometheusError(f"Prometheus at {self.url} refused {promql!r}: "
                                  f"{body.get('errorType', '?')}: {body.get('error', '?')}")
        data = body.get("data") or {}
        if data.get("resultType") != "vector":
            raise PrometheusError(f"Prometheus at {self.url} answered a {data.get('resultType')!r}, not a vector")
        return list(data.get("result") or [])

    def close(self) -> None:
        """Nothing runs in the background: Prometheus does the scraping."""


def _value(sample: Mapping[str, Any]) -> float:
    value = float(sample["value"][1])
    return value if math.isfinite(value) else math.nan


def _finite(value: float) -> float:
    return value if math.isfinite(value) else 0.0


def _json_or_none(error: urllib.error.HTTPError) -> dict[str, Any] | None:
    try:
        body = json.loads(error.read())
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None
