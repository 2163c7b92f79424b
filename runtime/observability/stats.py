"""Latency summaries, computed the same way everywhere numbers are printed."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0–100) by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass
class Summary:
    count: int
    ok: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    p999_ms: float
    rps: float
    statuses: dict[str, int]

    @classmethod
    def of(cls, latencies_s: Sequence[float], statuses: Sequence[str], wall_s: float) -> Summary:
        ms = [value * 1000.0 for value in latencies_s]
        counts = Counter(statuses)
        return cls(count=len(ms), ok=counts.get("OK", 0), p50_ms=percentile(ms, 50), p90_ms=percentile(ms, 90),
                   p99_ms=percentile(ms, 99), p999_ms=percentile(ms, 99.9),
                   rps=len(ms) / wall_s if wall_s > 0 else float("nan"), statuses=dict(counts))
