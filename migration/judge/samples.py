"""Per-request latency samples, from what a data path measured, for the judge's tests.

Two sources. The fronts keep every request's outcome (`migration.traffic.outcomes`): their
samples are the measured latencies themselves. A metrics system keeps only the
`spine_request_duration_seconds` histogram: each bucket's count in the window becomes that
many samples at the bucket's midpoint (the first bucket starts at 0; the +Inf bucket's
samples sit at the highest finite bound, as `histogram_quantile` treats them). The test
then sees ties at a few values, which Mann-Whitney's tie correction handles; a shift
smaller than a bucket's width shows only as far as it moves counts between buckets, so
buckets as fine as the shifts one cares about are what makes the histogram source sharp.
Above `MAX_BUCKET_SAMPLES` per side the counts are scaled down together, which only
lowers the test's power (fewer samples), never its false alarms.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

MAX_BUCKET_SAMPLES = 20_000


def bucket_samples_ms(cumulative: Mapping[float, float]) -> tuple[float, ...]:
    """Samples (ms) at the bucket midpoints of a window's cumulative histogram (le seconds -> count)."""
    ordered = sorted(cumulative.items())
    finite = [le for le, _ in ordered if math.isfinite(le)]
    if not finite:
        return ()
    counts: list[tuple[float, float, float]] = []  # (lower, upper, how many in the bucket)
    previous_le, previous_count = 0.0, 0.0
    for le, count in ordered:
        count = max(count, previous_count)  # cumulative counts never fall (float noise may)
        upper = le if math.isfinite(le) else finite[-1]
        lower = previous_le if math.isfinite(le) else finite[-1]
        counts.append((lower, upper, count - previous_count))
        previous_le, previous_count = (le if math.isfinite(le) else previous_le), count
    total = sum(n for _, _, n in counts)
    scale = min(1.0, MAX_BUCKET_SAMPLES / total) if total > 0 else 0.0
    samples: list[float] = []
    for lower, upper, n in counts:
        samples.extend([(lower + upper) / 2 * 1000.0] * round(n * scale))
    return tuple(samples)
