"""Token buckets as one tensor on the device: the table, its slots, shares and leases.

Every bucket is one column of a (6, n) float64 tensor (`bucket_cells`), allocated through
the device state so the memory budget sees it. A batch is decided on it by
`batch_decisions` (the torch ops, numpy on a CPU view, or one request after another on a
micro-batch, bit for bit alike); this module chooses the path and keeps the buckets.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from services.common import DeviceState
from services.common.host_view import HostView
from services.ratelimit.batch_decisions import (
    BatchDecision,
    BucketPairs,
    decide_alone,
    decide_on_device,
    decide_on_host,
    decide_sequential,
)
from services.ratelimit.bucket_cells import (
    BASE_CAPACITY,
    BASE_RATE,
    CAPACITY,
    LEVEL,
    RATE,
    ROWS,
)

OWNER = "ratelimit"

__all__ = ["OWNER", "BatchDecision", "BucketState", "TokenBucketTable"]


@dataclass(frozen=True)
class BucketState:
    """One bucket as the host sees it (level as of its last refill)."""

    level: float
    last_refill: float
    rate: float
    capacity: float


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
        host = self._host.of(self._state) if self.host_paths else None  # None: not the CPU
        if host is not None and n <= self.sequential_max:
            return decide_sequential(self._host.cells(self._state), row_slot, row_cost, row_request, charge, now)
        plan = BucketPairs(np.asarray(row_slot, np.int64), np.asarray(row_request, np.int64),
                           np.asarray(row_cost, np.float64), n)
        if host is not None:
            return decide_on_host(host, plan, np.asarray(charge, dtype=np.bool_), now)
        return decide_on_device(self._state, plan, charge, now)

    def slot_of(self, key: Hashable) -> int | None:
        """The slot a bucket lives in (None until its first decision); a slot never moves."""
        return self._slots.get(key)

    def decide_alone(self, row_slot: Sequence[int], row_cost: Sequence[float], charge: bool,
                     now: float) -> BatchDecision | None:
        """`decide` for a batch of one request whose rows name distinct buckets, on the host;
        None where that does not apply (the device is not the CPU, or a bucket repeats).

        Why: the rate limiter's decision for a lone request, the common case at low load
        (`batch_decisions.decide_alone`)."""
        state = self._host.cells(self._state) if self.host_paths else None
        if state is None or len(set(row_slot)) != len(row_slot):
            return None
        return decide_alone(state, row_slot, row_cost, charge, now)
