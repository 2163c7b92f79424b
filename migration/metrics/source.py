"""The interface between the gates and a metrics system, and what every source shares.

The gates need, per side and per window: how many requests ended, how many of them the
layout failed, and the p99 latency of the successful ones. Both sources read the same two
families exported by `services.metrics.service` — `spine_requests_total` (shadow traffic labelled
`shadow="true"` and left out) and the `spine_request_duration_seconds` histogram (shadow
traffic is timed in its own family, so it is never in this one).

The parity gate needs the shadow comparisons of the window, from the counters whoever
mirrors exports (`runtime.shadow.metrics`; reduced alike by `migration.metrics.parity`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Protocol

from migration.gates import ParityStats, WindowStats
from migration.target import ShadowCapability
from runtime.shadow.decisions import LAYOUT_ERRORS as LAYOUT_ERRORS

SIDES = ("layered", "spine")
REQUESTS = "spine_requests_total"
DURATION_BUCKETS = "spine_request_duration_seconds_bucket"
OK = "OK"


class MetricsSource(Protocol):
    def window(self, side: str, since: float) -> WindowStats:
        """`side`'s requests that ended from `since` (time.time()) until now.

        Never raises for a metrics system that cannot be read: the stats then say why in
        `missing`, and the gates hold."""
        ...

    def parity(self, since: float) -> ParityStats:
        """The shadow comparisons since `since`, noise over the `NOISE_WINDOWS` windows
        before now (`migration.metrics.parity`); like `window`, never raises: `missing` says
        why they could not be read."""
        ...

    def shadow_exported(self) -> ShadowCapability:
        """Whether anything this source reads exports shadow comparisons now (the mirror
        exports `spine_shadow_compared_total` from its start, before any comparison)."""
        ...

    def close(self) -> None:
        """Stop whatever the source runs in the background; safe to call twice."""
        ...


def check_side(side: str) -> None:
    if side not in SIDES:
        raise ValueError(f"side: expected one of {', '.join(SIDES)}, got {side!r}")


def stats_by_status(by_status: Mapping[str, float], p99_s: float | None, missing: str = "") -> WindowStats:
    """WindowStats from request counts per status and the OK requests' p99 (seconds)."""
    requests = round(sum(by_status.values()))
    errors = round(sum(count for status, count in by_status.items() if status in LAYOUT_ERRORS))
    ok = round(by_status.get(OK, 0.0))
    p99_ms = None if p99_s is None or not math.isfinite(p99_s) or ok == 0 else p99_s * 1000.0
    return WindowStats(requests, errors, p99_ms, ok, missing)


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """The q-quantile of cumulative `buckets` (upper bound -> count), as PromQL computes it.

    Linear interpolation inside the bucket that holds the rank (the first bucket starts at
    0); a rank in the +Inf bucket answers the highest finite bound. None without
    observations or without a +Inf bucket — the same cases in which Prometheus answers NaN.
    """
    ordered = sorted(buckets.items())
    if len(ordered) < 2 or ordered[-1][0] != math.inf:
        return None
    counts: list[float] = []
    for _, count in ordered:  # counts of a cumulative histogram never fall (floating-point noise may)
        counts.append(max(count, counts[-1]) if counts else count)
    total = counts[-1]
    if total <= 0:
        return None
    rank = q * total
    index = next(i for i, count in enumerate(counts) if count >= rank)
    if index == len(ordered) - 1:
        return ordered[-2][0]
    upper = ordered[index][0]
    if index == 0:
        if upper <= 0:
            return upper
        return upper * rank / counts[0]
    lower = ordered[index - 1][0]
    in_bucket = counts[index] - counts[index - 1]
    return lower + (upper - lower) * (rank - counts[index - 1]) / in_bucket
