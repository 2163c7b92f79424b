"""The fronts' weighted sticky split: the weight's share of keys goes to the spine, one key
always to one side at one weight, and a growing weight only moves keys towards the spine."""

from __future__ import annotations

import pytest

from migration.traffic.split import checked_weight, sticky_side

KEYS = [f"session-{n}" for n in range(4000)]


def spine_keys(weight: float) -> set[str]:
    return {key for key in KEYS if sticky_side(key, weight) == "spine"}


def test_the_weight_is_the_share_of_keys_sent_to_the_spine() -> None:
    assert spine_keys(0.0) == set()
    assert spine_keys(100.0) == set(KEYS)
    assert 0.20 < len(spine_keys(25.0)) / len(KEYS) < 0.30


def test_a_key_stays_on_its_side_while_the_weight_holds() -> None:
    assert [sticky_side(key, 40.0) for key in KEYS] == [sticky_side(key, 40.0) for key in KEYS]


def test_a_growing_weight_only_moves_keys_to_the_spine() -> None:
    assert spine_keys(5.0) <= spine_keys(5.01) <= spine_keys(25.0) <= spine_keys(50.0)


@pytest.mark.parametrize("weight", [-0.1, 100.5])
def test_a_weight_outside_0_to_100_is_refused_with_the_range(weight: float) -> None:
    with pytest.raises(ValueError, match="between 0 and 100"):
        checked_weight(weight)
