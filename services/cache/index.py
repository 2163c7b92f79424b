"""The response cache's index: an open-addressing hash table whose columns live on the device.

Why this shape: the spine probes a whole micro-batch at once, so a lookup must be one
gather-and-compare over tensors, not a dict walk per request. Each table position ("slot")
holds a 64-bit key hash, an expiry time and a last-used tick as tensor columns; the values
(response messages) and the full keys stay in host lists indexed by slot, where they are
cheapest to keep and to hand back.

Linear probing with a window: an entry sits at most `probe_limit` positions past its home
(hash mod table size), so a batched probe reads that window for every key at once and
never has to stop at an empty position. That is why deleting needs no tombstones: a freed
position only shortens nobody's probe. The table has at least twice as many positions as
entries, which keeps the window short.

A 64-bit hash can collide: every hash hit is confirmed against the full key on the host.

On the CPU there is no batch probe worth its setup: a dict from full key to slot finds a
request's entry in one hash lookup, where walking its probe window cell by cell grows with
the window (the longest displacement of any entry, which a full table makes long) and costs
several times as much a lookup and a store (timeit the two before changing this), and a
request pays both. The columns stay the state either
way: expiry, recency and the slots' hashes are read and written there, so the two paths
find, expire and evict alike (tests/integration/test_cache.py runs them side by side).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import numpy as np
import torch

from services.common import DeviceState

OWNER = "cache"
V = TypeVar("V")
KeyHash = Callable[[bytes], int]
_HASH, _TICK = 0, 1  # rows of the int64 column block; tick 0 marks a free slot
_NO_TICK = torch.iinfo(torch.int64).max


def default_key_hash(key: bytes) -> int:
    """The first 8 bytes of a sha256 digest, as a signed int64."""
    return int.from_bytes(key[:8], "little", signed=True)


class CacheIndex(Generic[V]):
    """Keys (sha256 digests) to slots, with TTL and least-recently-used eviction."""

    def __init__(self, device: DeviceState, max_entries: int, key_hash: KeyHash = default_key_hash) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries: must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._key_hash = key_hash
        size = 8
        while size < 2 * max_entries:
            size *= 2
        self._size = size
        self._meta = device.allocate(OWNER, (2, size), torch.int64)
        self._expiry = device.allocate(OWNER, (size,), torch.float64)
        self._offsets = torch.arange(size, dtype=torch.int64, device=self._meta.device)
        self._keys: list[bytes | None] = [None] * size
        self._slot_of: dict[bytes, int] = {}  # the live keys' slots (expired ones until freed)
        self._values: list[V | None] = [None] * size
        self._count = 0
        self._tick = 0
        self._probe_limit = 0
        self._next_expiry = math.inf  # no live entry expires before this (see remove_expired)
        # On the host, live slots in touch order (oldest first): the LRU victim in O(1)
        # instead of an argmin over every tick when a full cache stores.
        self._recency: dict[int, None] = {}
        # On the CPU the same columns are also seen as numpy arrays (zero-copy views of the
        # tensors' memory): the per-request probes then cost microseconds instead of the
        # tens of microseconds a torch op's dispatch costs. One state, two ways to read it.
        self._host = self._meta.device.type == "cpu"
        if self._host:
            self._meta_np = self._meta.numpy()
            self._expiry_np = self._expiry.numpy()
            self._offsets_np = self._offsets.numpy()
            # The same columns as memoryviews, for the few cells a request reads or writes
            # (plain CPython element access: see `services.common.host_view`).
            self._ticks_cells = memoryview(self._meta_np[_TICK])
            self._hash_cells = memoryview(self._meta_np[_HASH])
            self._expiry_cells = memoryview(self._expiry_np)  # type: ignore[arg-type]

    def __len__(self) -> int:
        """Entries held, expired ones included until `remove_expired` runs."""
        return self._count

    def lookup_batch(self, keys: Sequence[bytes], now: float) -> list[int]:
        """The slot of every unexpired key, or -1; hits become the most recently used."""
        if self._host:
            slot_of, expiry = self._slot_of, self._expiry_cells
            found = [slot if (slot := slot_of.get(key, -1)) >= 0 and expiry[slot] > now else -1
                     for key in keys]
            self._touch([slot for slot in found if slot >= 0])
            return found
        found = [-1] * len(keys)
        for query, slot in self._candidates(keys, now):
            if found[query] < 0 and self._keys[slot] == keys[query]:
                found[query] = slot
        self._touch([slot for slot in found if slot >= 0])
        return found

    def value(self, slot: int) -> V:
        value = self._values[slot]
        if value is None:
            raise KeyError(f"slot {slot} is empty")
        return value

    def put(self, key: bytes, value: V, now: float, ttl_s: float) -> bool:
        """Store `value` under `key` until `now + ttl_s`; True when an entry was evicted for room."""
        if self._host:
            slot = self._slot_of.get(key, -1)
        else:
            slot = next((s for q, s in self._candidates([key], None) if self._keys[s] == key), -1)
        evicted = False
        if slot < 0:
            if self._count >= self.max_entries:
                self.remove_expired(now)
            if self._count >= self.max_entries:
                self._free([self._least_recently_used()])
                evicted = True
            slot = self._claim(key)
        self._values[slot] = value
        if self._host:
            self._expiry_cells[slot] = now + ttl_s  # type: ignore[call-overload]  # a float64 column
        else:
            self._expiry[slot] = now + ttl_s
        self._next_expiry = min(self._next_expiry, now + ttl_s)
        self._touch([slot])
        return evicted

    def remove_expired(self, now: float) -> int:
        """Free every expired entry; returns how many.

        A full cache calls this on every store, so it first asks whether anything can have
        expired at all: `_next_expiry` is a lower bound on every live entry's expiry (the
        earliest one seen at the last scan or put since), which skips the table scan.
        """
        if now < self._next_expiry:
            return 0
        if self._host:
            live = self._meta_np[_TICK] > 0
            expired = np.flatnonzero(live & (self._expiry_np <= now)).tolist()
            left = self._expiry_np[live & (self._expiry_np > now)]
        else:
            live_t = self._meta[_TICK] > 0
            expired = torch.nonzero(live_t & (self._expiry <= now)).squeeze(1).tolist()
            left = self._expiry[live_t & (self._expiry > now)].cpu().numpy()
        self._next_expiry = float(left.min()) if left.size else math.inf
        if expired:
            self._free(expired)
            self._probe_limit = self._longest_probe()
        return len(expired)

    # -- internals ---------------------------------------------------------------------
    def _candidates(self, keys: Sequence[bytes], now: float | None) -> list[tuple[int, int]]:
        """(query index, slot) for every live slot whose hash equals the key's, in probe order
        (the tensor path: on the CPU the dict of keys answers instead)."""
        if not keys or self._count == 0:
            return []
        dev = self._meta.device
        hashes = torch.tensor([self._key_hash(k) for k in keys], dtype=torch.int64, device=dev)
        home = hashes & (self._size - 1)
        window = (home[:, None] + self._offsets[: self._probe_limit + 1]) & (self._size - 1)
        match = (self._meta[_TICK][window] > 0) & (self._meta[_HASH][window] == hashes[:, None])
        if now is not None:
            match &= self._expiry[window] > now
        hits = torch.nonzero(match)
        slots = window[hits[:, 0], hits[:, 1]]
        queries, found = torch.stack([hits[:, 0], slots]).tolist()
        return list(zip(queries, found, strict=True))

    def _claim(self, key: bytes) -> int:
        """The first free slot at or after the key's home; records it as the key's slot."""
        key_hash = self._key_hash(key)
        mask = self._size - 1
        home = key_hash & mask
        if self._host:  # the table is at most half full: the home slot or one of the next few is free
            ticks = self._ticks_cells
            distance = next((d for d in range(self._size) if ticks[(home + d) & mask] == 0), -1)
            if distance < 0:
                raise AssertionError("cache index is full")
            slot = (home + distance) & mask
            self._hash_cells[slot] = key_hash
        else:
            width = min(self._size, max(8, self._probe_limit + 1))
            while True:
                window = (home + self._offsets[:width]) & mask
                free = torch.nonzero(self._meta[_TICK][window] == 0)
                if free.numel():
                    distance = int(free[0, 0])
                    break
                if width == self._size:  # cannot happen: the table is at most half full
                    raise AssertionError("cache index is full")
                width = min(self._size, width * 2)
            slot = (home + distance) & mask
            self._meta[_HASH, slot] = key_hash
        self._probe_limit = max(self._probe_limit, distance)
        self._keys[slot] = key
        self._slot_of[key] = slot
        self._count += 1
        return slot

    def _touch(self, slots: list[int]) -> None:
        if not slots:
            return
        ticks = {slot: self._tick + 1 + i for i, slot in enumerate(slots)}  # the last touch wins
        self._tick += len(slots)
        if self._host:
            cells = self._ticks_cells
            for slot, tick in ticks.items():
                cells[slot] = tick
            for slot in slots:  # by last touch, like the ticks
                self._recency.pop(slot, None)
                self._recency[slot] = None
            return
        index = torch.tensor(list(ticks), dtype=torch.int64, device=self._meta.device)
        self._meta[_TICK, index] = torch.tensor(list(ticks.values()), dtype=torch.int64, device=self._meta.device)

    def _free(self, slots: list[int]) -> None:
        if self._host:
            if len(slots) <= 8:  # an eviction frees one: a few cell writes cost less than one fancy index
                cells = self._ticks_cells
                for slot in slots:
                    cells[slot] = 0
            else:
                self._meta_np[_TICK, slots] = 0
        else:
            self._meta[_TICK, torch.tensor(slots, dtype=torch.int64, device=self._meta.device)] = 0
        for slot in slots:
            key = self._keys[slot]
            if key is not None:
                del self._slot_of[key]
            self._keys[slot] = None
            self._values[slot] = None
            self._recency.pop(slot, None)
        self._count -= len(slots)

    def _least_recently_used(self) -> int:
        if self._host:  # the oldest in touch order is the live slot with the smallest tick
            return next(iter(self._recency))
        ticks = self._meta[_TICK]
        return int(torch.argmin(torch.where(ticks > 0, ticks, torch.full_like(ticks, _NO_TICK))))

    def _longest_probe(self) -> int:
        if self._host:
            live_np = self._meta_np[_TICK] > 0
            if not live_np.any():
                return 0
            gap = (self._offsets_np - (self._meta_np[_HASH] & (self._size - 1))) & (self._size - 1)
            return int(gap[live_np].max())
        live = self._meta[_TICK] > 0
        if not bool(live.any()):
            return 0
        distance = (self._offsets - (self._meta[_HASH] & (self._size - 1))) & (self._size - 1)
        return int(distance[live].max())
