"""Token buckets as one tensor on the device, decided a whole batch at a time.

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

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from services.common import DeviceState
from services.common.host_view import HostView
from services.ratelimit.bucket_cells import (
    BASE_CAPACITY,
    BASE_RATE,
    CAPACITY,
    LAST_REFILL,
    LEVEL,
    RATE,
    ROWS,
    refilled,
    retry_after,
    retry_rate,
    store,
)

OWNER = "ratelimit"


@dataclass(frozen=True)
class BucketState:
    """One bucket as the host sees it (level as of its last refill)."""

    level: float
    last_refill: float
    rate: float
    capacity: float


@dataclass(slots=True)  # not frozen: made per decision (see services.pipeline.batch_rpc)
class BatchDecision:
    """Per request: admitted. Per row (descriptor): fits, remaining after, retry-after."""

    admitted: list[bool]
    fits: list[bool]
    remaining: list[float]
    retry_after_s: list[float]  # 0 when the row fits, -1 when its cost exceeds the capacity
    rounds: int


class TokenBucketTable:
    """Buckets keyed by any hashable (a descriptor's entries), stored as one (6, n) tensor.

    The table grows by doubling: a new tensor is allocated through the device state, the
    old one copied and released, so the memory budget always sees what is really held.
    """

    def __init__(self, device: DeviceState, initial_slots: int = 64) -> None:
        self._device = device
        self._slots: dict[Hashable, int] = {}
        self._share = 1.0
        self._lease_reserve: float | None = None  # lease mode: see `lease`
        self._state = device.allocate(OWNER, (ROWS, max(1, initial_slots)), torch.float64)
        self._host = HostView()  # the numpy view of `_state` on the CPU (None elsewhere)
        # On the CPU, decide on Python floats (a micro-batch) or numpy views (a large batch)
        # of the same memory; False forces the torch ops CUDA uses (tests compare the paths).
        self.host_paths = True
        # Batches up to this many requests are decided one by one on the host (cheapest for
        # micro-batches); larger ones with numpy's cumulative sums.
        self.sequential_max = 64

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def share(self) -> float:
        return self._share

    def slots(self, keys: Sequence[Hashable], limits: Sequence[tuple[float, float]], now: float) -> list[int]:
        """The slot of every key; new keys get a full bucket with `limits` = (rate, capacity)."""
        new: dict[Hashable, tuple[float, float]] = {}
        for key, limit in zip(keys, limits, strict=True):
            if key not in self._slots and key not in new:
                new[key] = limit
        if new:
            self._add(new, now)
        return [self._slots[key] for key in keys]

    def _add(self, new: dict[Hashable, tuple[float, float]], now: float) -> None:
        first = len(self._slots)
        self._reserve(first + len(new))
        share, reserve = self._share, self._lease_reserve
        columns = [
            [cap * share, now, rate * share, cap * share, rate, cap] if reserve is None
            else [cap * reserve, now, 0.0, cap, rate, cap] for rate, cap in new.values()
        ]
        block = torch.tensor(columns, dtype=torch.float64, device=self._state.device).T
        self._state[:, first : first + len(new)] = block
        for offset, key in enumerate(new):
            self._slots[key] = first + offset

    def _reserve(self, needed: int) -> None:
        size = self._state.shape[1]
        if needed <= size:
            return
        while size < needed:
            size *= 2
        grown = self._device.allocate(OWNER, (ROWS, size), torch.float64)
        grown[:, : self._state.shape[1]] = self._state
        self._device.release(OWNER, self._state)
        self._state = grown

    def set_share(self, fraction: float) -> None:
        """Scale every bucket's rate and capacity to `fraction` of its configured limit.

        What a bucket holds is kept, clamped to the new capacity: a larger share never
        hands out tokens that were not earned.
        """
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"share: must be in (0, 1], got {fraction!r}")
        self._share = float(fraction)
        if self._lease_reserve is not None:  # leasing: the share waits for `lease(None)`
            return
        s = self._state
        s[RATE] = s[BASE_RATE] * self._share
        s[CAPACITY] = s[BASE_CAPACITY] * self._share
        s[LEVEL] = torch.minimum(s[LEVEL], s[CAPACITY])

    def lease(self, reserve: float | None) -> None:
        """Lease mode (`reserve` not None): buckets stop refilling and hold only the tokens
        credited to them (`credit`: leases from a shared store, `services.ratelimit.leases`),
        up to their whole configured burst; a new bucket starts with `reserve` of its burst.
        None: back to refilling at the share of each limit, levels clamped to it.

        Deciding is the same code either way: the hot path never knows which mode it is in."""
        self._lease_reserve = reserve
        if reserve is None:
            self.set_share(self._share)
            return
        s = self._state
        s[RATE] = 0.0
        s[CAPACITY] = s[BASE_CAPACITY]

    def credit(self, key: Hashable, tokens: float) -> float:
        """Add `tokens` (negative: take them out) to a bucket's level, within [0, capacity];
        returns what did not fit (for the store to have back)."""
        slot = self._slots[key]
        level = float(self._state[LEVEL, slot])
        new = min(max(level + tokens, 0.0), float(self._state[CAPACITY, slot]))
        self._state[LEVEL, slot] = new
        return tokens - (new - level)

    def settle(self, key: Hashable, tokens: float) -> float:
        """Take `tokens` more out of a bucket (negative: give them back) after the fact, its
        level kept within [-capacity, capacity]: a debt refills like any level, so it delays
        the next admissions by what was used beyond the estimate. Returns the level after
        (below zero: the bucket is in debt)."""
        slot = self._slots[key]
        cells = self._host.cells(self._state) if self.host_paths else None
        if cells is not None:  # every request settles: plain float cells on the CPU, not tensor indexing
            capacity = cells[CAPACITY, slot]
            level = cells[LEVEL, slot] = min(max(cells[LEVEL, slot] - tokens, -capacity), capacity)
            return float(level)
        capacity = float(self._state[CAPACITY, slot])
        level = min(max(float(self._state[LEVEL, slot]) - tokens, -capacity), capacity)
        self._state[LEVEL, slot] = level
        return level

    def state(self, key: Hashable) -> BucketState | None:
        slot = self._slots.get(key)
        if slot is None:
            return None
        return BucketState(*self._state[:4, slot].tolist())

    def snapshot(self) -> dict[Hashable, BucketState]:
        """Every bucket, for tests and `spine status`; one device-to-host copy."""
        columns = self._state[:4, : len(self._slots)].T.tolist()
        return {key: BucketState(*columns[slot]) for key, slot in self._slots.items()}

    def decide(
        self,
        row_slot: Sequence[int],
        row_cost: Sequence[float],
        row_request: Sequence[int],
        charge: Sequence[bool],
        now: float,
    ) -> BatchDecision:
        """Decide requests in order; rows are descriptors, `charge[i]` False for dry runs.

        A request is admitted when every one of its rows fits; an admitted request with
        `charge` set takes its costs from its buckets. Rows of one request that name the
        same bucket are charged together. Index bookkeeping (which rows share a bucket)
        is done on the host with numpy; the buckets are read and written once, on the device.
        """
        n = len(charge)
        host = self.host_paths and self._host.of(self._state) is not None
        if host and n <= self.sequential_max:
            return self._decide_sequential(row_slot, row_cost, row_request, charge, now)
        plan = _Plan(np.asarray(row_slot, np.int64), np.asarray(row_request, np.int64), np.asarray(row_cost, np.float64), n)
        if host:
            return self._decide_host(plan, np.asarray(charge, dtype=np.bool_), now)
        dev = self._state.device
        slots = torch.from_numpy(plan.slots).to(dev)
        index = torch.from_numpy(np.stack([plan.pair_bucket, plan.pair_request, plan.segment_first])).to(dev)
        pair_bucket, pair_req, segment_first = index[0], index[1], index[2]
        pair_cost = torch.from_numpy(plan.pair_cost).to(dev)
        charge_t = torch.from_numpy(np.asarray(charge, dtype=np.bool_)).to(dev)

        cols = self._state[:, slots]
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
        self._state[:, slots] = cols

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


    def _decide_host(self, plan: _Plan, charge: np.ndarray, now: float) -> BatchDecision:
        """`decide` on a zero-copy numpy view of the CPU table: the same float64 operations in
        the same order (torch's per-op dispatch costs more than these tiny arrays' maths)."""
        n = len(charge)
        state = self._host.of(self._state)
        assert state is not None  # only called on the CPU
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

    def slot_of(self, key: Hashable) -> int | None:
        """The slot a bucket lives in (None until its first decision); a slot never moves."""
        return self._slots.get(key)

    def decide_alone(self, row_slot: Sequence[int], row_cost: Sequence[float], charge: bool,
                     now: float) -> BatchDecision | None:
        """`decide` for a batch of one request whose rows name distinct buckets, on the host;
        None where that does not apply (the device is not the CPU, or a bucket repeats).

        Why: the rate limiter's decision for a lone request, the common case at low load,
        without `_decide_sequential`'s per-request dicts. The same float operations in the
        same order, so the answers and levels are `_decide_sequential`'s bit for bit (the
        property tests compare them)."""
        state = self._host.cells(self._state) if self.host_paths else None
        if state is None or len(set(row_slot)) != len(row_slot):
            return None
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

    def _decide_sequential(self, row_slot: Sequence[int], row_cost: Sequence[float], row_request: Sequence[int],
                           charge: Sequence[bool], now: float) -> BatchDecision:
        """A small batch on a CPU table: literally one request after another, on Python floats
        read from (and written back to) a zero-copy memoryview of the table.

        The same float64 operations as `decide`'s cumulative sums (see the module
        docstring: every subtraction of a whole cost is exact), so the answers and levels
        are bit for bit those of the torch ops; for the few requests of a micro-batch this
        costs a tenth of the array bookkeeping. The property tests compare all three paths.
        """
        n = len(charge)
        wants: list[dict[int, float]] = [{} for _ in range(n)]  # per request: bucket -> summed cost
        for slot, cost, request in zip(row_slot, row_cost, row_request, strict=True):
            costs = wants[request]
            costs[slot] = costs.get(slot, 0.0) + float(cost)
        state = self._host.cells(self._state)
        assert state is not None  # only called on the CPU
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


class _Plan:
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
