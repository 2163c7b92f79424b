"""Deciding a batch of requests against token buckets: which are admitted, what each row leaves.

The table (`token_buckets.TokenBucketTable`) keeps the buckets; this decides on them. Three
paths give the same answers bit for bit (the property tests compare them): the torch ops, on
any device (what CUDA runs); the same float64 operations on a zero-copy numpy view of a CPU
table, for a large batch; and one request after another on Python floats, for a micro-batch.
They live apart from the table because they are the arithmetic the exactness argument below
is about, while the table is storage (slots, growth, shares, leases).

A batch must give *exactly* the decisions (and leave exactly the levels) that deciding the
same requests one by one would. That holds bit for bit because costs are whole numbers
(below 2**53) and a bucket is only charged down to >= 0: subtracting a whole number from a
float64 level and landing in [0, level] is exact, so `(level - a) - b == level - (a + b)`
and `a + b <= level` decides exactly like `b <= level - a`. A refill at time `now` is a
no-op on a bucket already refilled at `now`, so both runs refill each bucket identically.

The batch decision is a fixed point. Request k's decision depends only on which earlier
requests were admitted (they charged the buckets). Start by assuming every request is
admitted, compute every decision with a segmented cumulative sum per bucket, then repeat
with the decisions just computed until nothing changes. After round r the first r
decisions are final, so the loop ends within len(batch) + 1 rounds; under normal load and
under uniform overload it ends in two or three.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from services.ratelimit.bucket_cells import (
    BASE_RATE,
    CAPACITY,
    LAST_REFILL,
    LEVEL,
    RATE,
    refilled,
    retry_after,
    retry_rate,
    store,
)


@dataclass(slots=True)  # not frozen: made per decision (see services.pipeline.batch_rpc)
class BatchDecision:
    """Per request: admitted. Per row (descriptor): fits, remaining after, retry-after."""

    admitted: list[bool]
    fits: list[bool]
    remaining: list[float]
    retry_after_s: list[float]  # 0 when the row fits, -1 when its cost exceeds the capacity
    rounds: int


class BucketPairs:
    """Which rows share a bucket: one "pair" per (bucket, request), sorted by bucket then
    request, so each bucket's pairs form a segment in arrival order."""

    def __init__(self, row_slot: np.ndarray, row_request: np.ndarray, row_cost: np.ndarray, n: int) -> None:
        pairs, row_pair = np.unique(row_slot * n + row_request, return_inverse=True)
        pair_slot = pairs // n
        self.row_pair: list[int] = row_pair.reshape(-1).tolist()
        self.pair_request = pairs - pair_slot * n
        self.pair_cost = np.bincount(row_pair.reshape(-1), weights=row_cost, minlength=len(pairs))
        self.slots, self.pair_bucket = np.unique(pair_slot, return_inverse=True)
        self.pair_bucket = self.pair_bucket.reshape(-1)
        self.segment_first = np.searchsorted(pair_slot, pair_slot, side="left")


def decide_on_device(state: torch.Tensor, plan: BucketPairs, charge: Sequence[bool], now: float) -> BatchDecision:
    """The batch on the table's tensor (`state`, one column per bucket), with torch ops: the
    path CUDA takes. Index bookkeeping (which rows share a bucket, `plan`) was done on the
    host with numpy; the buckets are read and written once, on the device."""
    n = len(charge)
    dev = state.device
    slots = torch.from_numpy(plan.slots).to(dev)
    index = torch.from_numpy(np.stack([plan.pair_bucket, plan.pair_request, plan.segment_first])).to(dev)
    pair_bucket, pair_req, segment_first = index[0], index[1], index[2]
    pair_cost = torch.from_numpy(plan.pair_cost).to(dev)
    charge_t = torch.from_numpy(np.asarray(charge, dtype=np.bool_)).to(dev)

    cols = state[:, slots]
    # Refill on use; time that runs backwards earns nothing.
    elapsed = (now - cols[LAST_REFILL]).clamp(min=0.0)
    bucket_level = torch.minimum(cols[CAPACITY], cols[LEVEL] + cols[RATE] * elapsed)
    level = bucket_level[pair_bucket]

    admitted = torch.ones(n, dtype=torch.bool, device=dev)
    rounds = 0
    while True:
        rounds += 1
        taken = pair_cost * (admitted & charge_t)[pair_req]
        before = torch.cumsum(taken, 0) - taken  # exact: sums of whole numbers
        earlier = before - before[segment_first]
        fits = earlier + pair_cost <= level
        misses = torch.zeros(n, dtype=torch.int64, device=dev).index_add_(0, pair_req, (~fits).to(torch.int64))
        decided = misses == 0
        if torch.equal(decided, admitted):
            break
        admitted = decided
        if rounds > n + 1:  # cannot happen: round r fixes the first r decisions
            raise AssertionError(f"batch admission did not converge in {rounds} rounds")

    # `taken` is what the final decisions charge.
    remaining = level - (earlier + taken)
    wait = ((earlier + pair_cost) - level) / retry_rate(cols)[pair_bucket]
    never = pair_cost > cols[CAPACITY][pair_bucket]
    retry = torch.where(fits, torch.zeros_like(wait), torch.where(never, torch.full_like(wait, -1.0), wait))
    cols[LEVEL] = bucket_level - torch.zeros_like(bucket_level).index_add_(0, pair_bucket, taken)
    cols[LAST_REFILL] = cols[LAST_REFILL].clamp(min=now)
    state[:, slots] = cols

    flat = torch.cat([admitted.to(torch.float64), fits.to(torch.float64), remaining, retry]).tolist()
    pairs = len(plan.pair_cost)
    fits_p, remaining_p, retry_p = (flat[n + k * pairs : n + (k + 1) * pairs] for k in range(3))
    return BatchDecision(
        admitted=[a > 0 for a in flat[:n]],
        fits=[fits_p[p] > 0 for p in plan.row_pair],
        remaining=[remaining_p[p] for p in plan.row_pair],
        retry_after_s=[retry_p[p] for p in plan.row_pair],
        rounds=rounds,
    )


def decide_on_host(state: np.ndarray, plan: BucketPairs, charge: np.ndarray, now: float) -> BatchDecision:
    """The batch on a zero-copy numpy view of a CPU table (`state`): the same float64 operations in
    the same order (torch's per-op dispatch costs more than these tiny arrays' maths)."""
    n = len(charge)
    cols = state[:, plan.slots]
    elapsed = np.maximum(now - cols[LAST_REFILL], 0.0)
    bucket_level = np.minimum(cols[CAPACITY], cols[LEVEL] + cols[RATE] * elapsed)
    level = bucket_level[plan.pair_bucket]
    pair_cost, pair_req = plan.pair_cost, plan.pair_request
    admitted = np.ones(n, dtype=np.bool_)
    rounds = 0
    while True:
        rounds += 1
        taken = pair_cost * (admitted & charge)[pair_req]
        before = np.cumsum(taken) - taken
        earlier = before - before[plan.segment_first]
        fits = earlier + pair_cost <= level
        decided = np.bincount(pair_req, weights=~fits, minlength=n) == 0
        if np.array_equal(decided, admitted):
            break
        admitted = decided
        if rounds > n + 1:
            raise AssertionError(f"batch admission did not converge in {rounds} rounds")
    remaining = level - (earlier + taken)
    rate = np.where(cols[RATE] > 0, cols[RATE], cols[BASE_RATE])[plan.pair_bucket]
    with np.errstate(divide="ignore", invalid="ignore"):
        wait = ((earlier + pair_cost) - level) / rate
    never = pair_cost > cols[CAPACITY][plan.pair_bucket]
    retry = np.where(fits, 0.0, np.where(never, -1.0, wait))
    cols[LEVEL] = bucket_level - np.bincount(plan.pair_bucket, weights=taken, minlength=len(plan.slots))
    cols[LAST_REFILL] = np.maximum(cols[LAST_REFILL], now)
    state[:, plan.slots] = cols
    fits_p, remaining_p, retry_p = fits.tolist(), remaining.tolist(), retry.tolist()
    return BatchDecision(
        admitted=admitted.tolist(),
        fits=[fits_p[p] for p in plan.row_pair],
        remaining=[remaining_p[p] for p in plan.row_pair],
        retry_after_s=[retry_p[p] for p in plan.row_pair],
        rounds=rounds,
    )


def decide_sequential(state: Any, row_slot: Sequence[int], row_cost: Sequence[float], row_request: Sequence[int],
                  charge: Sequence[bool], now: float) -> BatchDecision:
    """A small batch on a CPU table: literally one request after another, on Python floats
    read from (and written back to) a zero-copy memoryview of the table (`state`).

    The same float64 operations as the cumulative sums of the other paths (see the module
    docstring: every subtraction of a whole cost is exact), so the answers and levels
    are bit for bit those of the torch ops; for the few requests of a micro-batch this
    costs a tenth of the array bookkeeping. The property tests compare all three paths.
    """
    n = len(charge)
    wants: list[dict[int, float]] = [{} for _ in range(n)]  # per request: bucket -> summed cost
    for slot, cost, request in zip(row_slot, row_cost, row_request, strict=True):
        costs = wants[request]
        costs[slot] = costs.get(slot, 0.0) + float(cost)
    level: dict[int, float] = {}
    last: dict[int, float] = {}
    rate: dict[int, float] = {}
    cap: dict[int, float] = {}
    for slot in dict.fromkeys(row_slot):
        level[slot], last[slot], rate[slot], cap[slot] = refilled(state, slot, now)
    admitted: list[bool] = []
    outcome: list[dict[int, tuple[bool, float, float]]] = []  # per request: bucket -> (fits, left, retry)
    for request, costs in enumerate(wants):
        ok = all(cost <= level[slot] for slot, cost in costs.items())
        take = ok and bool(charge[request])
        out: dict[int, tuple[bool, float, float]] = {}
        for slot, cost in costs.items():
            current = level[slot]
            retry = retry_after(cost, current, rate[slot], cap[slot])
            if take:
                level[slot] = current - cost
            out[slot] = (cost <= current, level[slot], retry)
        admitted.append(ok)
        outcome.append(out)
    for slot, value in level.items():
        store(state, slot, value, last[slot], now)
    rows = [outcome[request][slot] for slot, request in zip(row_slot, row_request, strict=True)]
    return BatchDecision(
        admitted=admitted,
        fits=[fits for fits, _, _ in rows],
        remaining=[left for _, left, _ in rows],
        retry_after_s=[retry for _, _, retry in rows],
        rounds=1,
    )


def decide_alone(state: Any, row_slot: Sequence[int], row_cost: Sequence[float], charge: bool,
             now: float) -> BatchDecision:
    """A batch of one request whose rows name distinct buckets, on the memoryview of a CPU
    table (`state`).

    Why: the rate limiter's decision for a lone request, the common case at low load,
    without `decide_sequential`'s per-request dicts. The same float operations in the
    same order, so the answers and levels are `decide_sequential`'s bit for bit (the
    property tests compare them)."""
    rows = [(slot, 0.0 + float(cost), *refilled(state, slot, now))
            for slot, cost in zip(row_slot, row_cost, strict=True)]
    ok = all(cost <= level for _, cost, level, _, _, _ in rows)
    take = ok and charge
    fits_out, left_out, retry_out = [], [], []
    for slot, cost, level, last, rate, cap in rows:
        fits_out.append(cost <= level)
        retry_out.append(retry_after(cost, level, rate, cap))
        if take:
            level = level - cost
        store(state, slot, level, last, now)
        left_out.append(level)
    return BatchDecision(admitted=[ok], fits=fits_out, remaining=left_out, retry_after_s=retry_out, rounds=1)
