"""What the parity gate reads: shadow comparisons, from the counters whoever mirrors exports.

The front (local) and the spine's gateway (behind Envoy) count every comparison in
`spine_shadow_compared_total` and every field that differed as a cause in
`spine_shadow_mismatched_total` (`runtime.shadow.metrics`). Per window the gate needs:

- how many answers were compared across layouts (`calibration="false"`): none at all is
  no evidence, and the gate holds;
- how many fields differed across layouts, by field;
- which fields are noise: those on which the baseline (layered) disagreed with itself
  (`calibration="true"`, `primary="layered"`) over the last `NOISE_WINDOWS` windows. Their mismatches are not counted; a
  field that has been quiet that long counts again, so one odd answer does not switch a
  field's check off for the rest of a rollout.

Both metrics sources (`promql`, `scrape`) reduce their samples to `ShadowCounts` and call
`parity_stats`, so they count alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from migration.gates import ParityStats
from runtime.shadow.metrics import COMPARED, MISMATCHED

# Noise is what the baseline disagreed with itself on over this many windows (the current
# one and the ones before it): calibration copies are a small share of a small share.
NOISE_WINDOWS = 10
# Noise is what the baseline disagrees with itself on. The spine disagreeing with itself (a
# sampling bug, say) must not excuse its answers differing from the baseline's: it did, once,
# in `make run` — a calibration pair on a spine faulted to sample made `tokens` noise, and the
# parity fault was promoted.
BASELINE = "layered"
SHADOW_FAMILIES = (COMPARED, MISMATCHED)


@dataclass(frozen=True)
class ShadowCounts:
    """Comparison counts (a window's increase, or running totals) summed over every mirror."""

    compared: float = 0.0  # across layouts
    calibration_compared: float = 0.0  # a layout with itself
    mismatched: Mapping[str, float] = field(default_factory=dict)  # field -> across layouts
    noise: Mapping[str, float] = field(default_factory=dict)  # field -> a layout with itself

    def __add__(self, other: ShadowCounts) -> ShadowCounts:
        return ShadowCounts(self.compared + other.compared, self.calibration_compared + other.calibration_compared,
                            _combine(self.mismatched, other.mismatched, 1.0), _combine(self.noise, other.noise, 1.0))

    def __sub__(self, other: ShadowCounts) -> ShadowCounts:
        return ShadowCounts(self.compared - other.compared, self.calibration_compared - other.calibration_compared,
                            _combine(self.mismatched, other.mismatched, -1.0),
                            _combine(self.noise, other.noise, -1.0))


def _combine(a: Mapping[str, float], b: Mapping[str, float], sign: float) -> dict[str, float]:
    return {key: a.get(key, 0.0) + sign * b.get(key, 0.0) for key in a.keys() | b.keys()}


def add_sample(counts: ShadowCounts, name: str, labels: Mapping[str, str], value: float) -> ShadowCounts:
    """`counts` plus one sample of a shadow family (any other sample: `counts` unchanged)."""
    calibration = labels.get("calibration") == "true"
    if name == COMPARED:
        if calibration:
            return counts + ShadowCounts(calibration_compared=value)
        return counts + ShadowCounts(compared=value)
    if name == MISMATCHED and labels.get("field"):
        by_field = {labels["field"]: value}
        if not calibration:
            return counts + ShadowCounts(mismatched=by_field)
        if labels.get("primary", BASELINE) == BASELINE:
            return counts + ShadowCounts(noise=by_field)
    return counts  # a spine that disagrees with itself is a defect to catch, never an excuse


def parity_stats(window: ShadowCounts, noise: Mapping[str, float]) -> ParityStats:
    """The gate's view of one window: `window` its increase, `noise` the calibration
    mismatches by field over the noise horizon (`NOISE_WINDOWS`)."""
    noisy = tuple(sorted(name for name, count in noise.items() if count >= 0.5))
    by_field = {name: round(count) for name, count in window.mismatched.items() if round(count) > 0}
    counted = sum(count for name, count in by_field.items() if name not in noisy)
    return ParityStats(round(window.compared), counted, by_field, noisy)
