"""One bucket's cells in the token-bucket table and their arithmetic: refill, retry-after, write-back.

The table (`token_buckets.TokenBucketTable`) keeps every bucket as one column of a state
tensor with these rows; the batched and one-at-a-time decisions (`batch_decisions`) both
read and write a bucket through these functions, so the two give the same answers.
"""

from __future__ import annotations

import math
from typing import Any

import torch

# Rows of the state tensor, one column per bucket.
LEVEL, LAST_REFILL, RATE, CAPACITY, BASE_RATE, BASE_CAPACITY = range(6)
ROWS = 6


def refilled(state: Any, slot: int, now: float) -> tuple[float, float, float, float]:
    """A bucket's (level now, last refill, rate, capacity), read from the table's host cells:
    refilled on use, and time that runs backwards earns nothing."""
    last, rate, cap = state[LAST_REFILL, slot], state[RATE, slot], state[CAPACITY, slot]
    # A leased bucket (rate 0) reports its configured rate: retry-after is when the store refills.
    return min(cap, state[LEVEL, slot] + rate * max(now - last, 0.0)), last, rate or state[BASE_RATE, slot], cap


def retry_rate(cols: torch.Tensor) -> torch.Tensor:
    """The rate a wait is computed with: a leased bucket's (0) is its configured one."""
    return torch.where(cols[RATE] > 0, cols[RATE], cols[BASE_RATE])


def retry_after(cost: float, level: float, rate: float, cap: float) -> float:
    """0 when `cost` fits `level`; -1 when it never can (over the capacity); else the wait."""
    if cost <= level:
        return 0.0
    if cost > cap:
        return -1.0
    return (cost - level) / rate if rate > 0 else math.inf


def store(state: Any, slot: int, level: float, last: float, now: float) -> None:
    """Write a decided bucket back: its level, refilled up to `now`."""
    state[LEVEL, slot] = level
    state[LAST_REFILL, slot] = max(last, now)
