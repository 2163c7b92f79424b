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

import torch

from services.common import DeviceState

# Rows of the state tensor, one column per bucket.
LEVEL, LAST_REFILL, RATE, CAPACITY, BASE_RATE, BASE_CAPACITY = range(6)
_ROWS = 6
OWNER = "ratelimit"


@dataclass(frozen=True)
class BucketState:
    """One bucket as the host sees it (level as of its last refill)."""

    level: float
    last_refill: float
    rate: float
    capacity: float


@dataclass(frozen=True)
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
        self._state = device.allocate(OWNER, (_ROWS, max(1, initial_slots)), torch.float64)

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
        share = self._share
        columns = [
            [cap * share, now, rate * share, cap * share, rate, cap] for rate, cap in new.values()
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
        grown = self._device.allocate(OWNER, (_ROWS, size), torch.float64)
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
        s = self._state
        s[RATE] = s[BASE_RATE] * self._share
        s[CAPACITY] = s[BASE_CAPACITY] * self._share
        s[LEVEL] = torch.minimum(s[LEVEL], s[CAPACITY])

    def state(self, key: Hashable) -> BucketState | None:
        slot = self._slots.get(key)
        if slot is None:
            return None
        return BucketState(*self._state[:4, slot].tolist())

    def snapshot(self) -> dict[Hashable, BucketState]:
        """Every bucket, for tests and `spine status`; one device-to-host copy."""
        columns = self._state[:4, : len(self._slots)].T.tolist()
        return {key: BucketState(*columns[slot]) for key, slot in self._slots.items()}

    def _refill(self, slots: torch.Tensor, now: float) -> None:
        """Top up `slots` to `now`; time that runs backwards earns nothing and moves nothing."""
        s = self._state
        cols = s[:, slots]
        elapsed = (now - cols[LAST_REFILL]).clamp(min=0.0)
        cols[LEVEL] = torch.minimum(cols[CAPACITY], cols[LEVEL] + cols[RATE] * elapsed)
        cols[LAST_REFILL] = cols[LAST_REFILL].clamp(min=now)
        s[:, slots] = cols

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
        same bucket are charged together.
        """
        n = len(charge)
        dev = self._state.device
        slot_t = torch.tensor(row_slot, dtype=torch.int64, device=dev)
        cost_t = torch.tensor(row_cost, dtype=torch.float64, device=dev)
        req_t = torch.tensor(row_request, dtype=torch.int64, device=dev)
        charge_t = torch.tensor(charge, dtype=torch.bool, device=dev)

        self._refill(torch.unique(slot_t), now)

        # One "pair" per (bucket, request), sorted by bucket then request: arrival order
        # within each bucket's segment.
        pairs, row_pair = torch.unique(slot_t * n + req_t, return_inverse=True)
        pair_slot = torch.div(pairs, n, rounding_mode="floor")
        pair_req = pairs - pair_slot * n
        pair_cost = torch.zeros(pairs.shape[0], dtype=torch.float64, device=dev).index_add_(0, row_pair, cost_t)
        cols = self._state[:, pair_slot]
        level = cols[LEVEL]
        starts = torch.ones_like(pair_slot, dtype=torch.bool)
        starts[1:] = pair_slot[1:] != pair_slot[:-1]
        segment_first = torch.nonzero(starts).squeeze(1)[torch.cumsum(starts.to(torch.int64), 0) - 1]

        admitted = torch.ones(n, dtype=torch.bool, device=dev)
        rounds = 0
        while True:
            rounds += 1
            taken = pair_cost * (admitted & charge_t)[pair_req].to(torch.float64)
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

        charged = pair_cost * (admitted & charge_t)[pair_req].to(torch.float64)
        remaining = level - (earlier + charged)
        capacity, rate = cols[CAPACITY], cols[RATE]
        wait = ((earlier + pair_cost) - level) / rate
        retry = torch.where(fits, torch.zeros_like(wait), torch.where(pair_cost > capacity, -torch.ones_like(wait), wait))
        self._state[LEVEL].index_add_(0, pair_slot, -charged)

        per_row = torch.stack([fits.to(torch.float64), remaining, retry])[:, row_pair].tolist()
        return BatchDecision(
            admitted=[bool(a) for a in admitted.tolist()],
            fits=[bool(f) for f in per_row[0]],
            remaining=per_row[1],
            retry_after_s=per_row[2],
            rounds=rounds,
        )
