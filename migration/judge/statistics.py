"""One metric's two samples compared with scipy: Mann-Whitney U for latency, Fisher's exact test
for error counts.

Why these: latency is skewed and heavy-tailed, so a test on means or on one percentile is
either wrong or noisy; Mann-Whitney asks whether one side tends to be slower, whatever the
shape, and the Hodges–Lehmann estimate (the median of every spine - layered difference)
says by how much, with its confidence interval. Error counts are small; Fisher's test is
exact where a normal approximation would not be.

The interval is the Moses interval that goes with the test (R's `wilcox.test(conf.int=TRUE)`
with the normal approximation): the ordered pairwise differences between the ranks that
`scipy.stats.norm` gives for the confidence. Above `MAX_PAIRED` samples a side is thinned to
evenly spaced order statistics first (the distribution kept, the interval only wider).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray
from scipy import stats
from scipy.stats.contingency import odds_ratio

MAX_PAIRED = 2000  # per side, for the pairwise differences (2000 x 2000 = 4 M of them)


@dataclass(frozen=True)
class Shift:
    """How the spine's sample sits against the layered one's: the Mann-Whitney p-value (two
    sided), the Hodges–Lehmann shift (spine - layered, the samples' unit) and its interval,
    the layered median (to say the shift in percent) and what was kept of each side."""

    p_value: float
    estimate: float
    low: float
    high: float
    baseline_median: float
    layered_n: int
    spine_n: int
    removed: int  # outliers removed, both sides together

    @property
    def relative(self) -> float | None:
        return self.estimate / self.baseline_median if self.baseline_median > 0 else None


@dataclass(frozen=True)
class ErrorComparison:
    """Fisher's exact test (one sided: does the spine fail more often?) and the odds ratio of
    failing, spine against layered, with its exact (conditional) interval."""

    p_value: float
    layered_rate: float
    spine_rate: float
    odds_ratio: float
    low: float
    high: float

    @property
    def delta(self) -> float:
        return self.spine_rate - self.layered_rate


def without_outliers(values: Sequence[float] | NDArray[np.float64], method: str,
                     factor: float) -> NDArray[np.float64]:
    """`values` less those beyond `factor` interquartile ranges from the quartiles (`iqr`), or
    all of them (`none`)."""
    data = np.asarray(values, dtype=np.float64)
    if method == "none" or data.size < 4:
        return data
    q1, q3 = np.percentile(data, [25, 75])
    spread = float(stats.iqr(data))
    kept: NDArray[np.float64] = data[(data >= q1 - factor * spread) & (data <= q3 + factor * spread)]
    return kept


def location_shift(layered: NDArray[np.float64], spine: NDArray[np.float64], confidence: float,
                   removed: int = 0) -> Shift:
    """Mann-Whitney U and the Hodges–Lehmann shift of `spine` against `layered` (module doc)."""
    p_value = float(stats.mannwhitneyu(spine, layered, alternative="two-sided").pvalue)
    x, y = _thinned(spine), _thinned(layered)
    differences = np.sort(np.subtract.outer(x, y).ravel())
    total = differences.size
    z = float(stats.norm.ppf(1 - (1 - confidence) / 2))
    rank = math.floor(total / 2 - z * math.sqrt(x.size * y.size * (x.size + y.size + 1) / 12))
    if rank < 1:
        low, high = -math.inf, math.inf
    else:
        low, high = float(differences[rank - 1]), float(differences[total - rank])
    return Shift(p_value if math.isfinite(p_value) else 1.0, float(np.median(differences)), low, high,
                 float(np.median(layered)), int(layered.size), int(spine.size), removed)


def _thinned(values: NDArray[np.float64]) -> NDArray[np.float64]:
    if values.size <= MAX_PAIRED:
        return values
    ordered = np.sort(values)
    thinned: NDArray[np.float64] = ordered[np.linspace(0, ordered.size - 1, MAX_PAIRED).round().astype(int)]
    return thinned


def compare_errors(layered_errors: int, layered_requests: int, spine_errors: int, spine_requests: int,
                   confidence: float) -> ErrorComparison:
    """Fisher's exact test on the 2x2 table (spine, layered) x (failed, not)."""
    table = [[spine_errors, spine_requests - spine_errors], [layered_errors, layered_requests - layered_errors]]
    p_value = float(stats.fisher_exact(table, alternative="greater").pvalue)
    ratio = odds_ratio(table, kind="conditional")
    interval = ratio.confidence_interval(confidence_level=confidence)
    return ErrorComparison(p_value, layered_errors / layered_requests, spine_errors / spine_requests,
                           float(ratio.statistic), float(interval.low), float(interval.high))
