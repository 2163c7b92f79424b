"""The parity gate's noise: only what the baseline (layered) disagrees with itself on.

`make run` once promoted a spine faulted to sample: a calibration copy that hit the spine
twice found it disagreeing with itself on `tokens`, `tokens` became noise, and every token
mismatch against the layered answers was excused."""

from __future__ import annotations

from migration.metrics.parity import ShadowCounts, add_sample, parity_stats
from migration.metrics.promql import mismatched_query
from spine.runtime.shadow_metrics import COMPARED, MISMATCHED


def _window(calibration_primary: str) -> tuple[ShadowCounts, ShadowCounts]:
    window = add_sample(ShadowCounts(), COMPARED, {"calibration": "false", "primary": "layered", "shadow": "spine"}, 20)
    window = add_sample(window, MISMATCHED, {"calibration": "false", "field": "tokens", "primary": "layered",
                                             "shadow": "spine"}, 13)
    noise = add_sample(ShadowCounts(), MISMATCHED, {"calibration": "true", "field": "tokens",
                                                    "primary": calibration_primary, "shadow": calibration_primary}, 1)
    return window, noise


def test_the_baseline_disagreeing_with_itself_makes_a_field_noise() -> None:
    window, noise = _window("layered")
    stats = parity_stats(window, noise.noise)
    assert stats.noisy_fields == ("tokens",) and stats.mismatches == 0


def test_a_spine_disagreeing_with_itself_excuses_nothing() -> None:
    window, noise = _window("spine")
    stats = parity_stats(window, noise.noise)
    assert stats.noisy_fields == () and stats.mismatches == 13


def test_prometheus_reads_the_baselines_calibration_only() -> None:
    assert 'primary="layered"' in mismatched_query("", "30s", calibration=True)
    assert "primary" not in mismatched_query("", "30s", calibration=False)
