"""Shared prefixes for a slot pool: a system prompt's KV computed once, copied into each slot.

A model whose cache is one region per slot (`hf_step.SlotPool`: a transformers model's
keys and values at [slot, kv_heads, position, head_dim]) cannot map one prefix into many
slots as the paged pool does (`kv_pool`). It keeps a copy instead:

* **Stored once, after its first prefill.** The first request with a shared part (BOS and
  its system prompt, `GenerationRequest.prefix_ids`) is prefilled whole; right after that
  step the keys and values of those positions are copied out of its slot into an entry
  keyed by exactly those token ids. The store belongs to one engine, hence to one model:
  the same tokens under another model are another store's entries.
* **Reused by copy.** A later request whose shared part has the same tokens gets the
  entry's keys and values copied into its own slot at admission (a memory copy, no
  forward) and is prefilled from the first position after them. Requests admitted before
  the entry exists (the same step) compute the prefix themselves.
* **Counted, bounded, evicted.** An entry's tensors are allocated through the device state
  (charged to `inference.kv_cache`, beside the pool) and the store holds at most
  `budget_bytes`: what the KV budget (`kv_cpu_memory_cap_mb` × `kv_memory_fraction` −
  weights, on the CPU) leaves after the slot pool. A new entry evicts the least recently
  used ones until it fits; one larger than the whole budget, or one the device budget
  refuses, is not stored (the request was served all the same). Since every reader has
  its own copy, any entry can go at any time.

Why the answer is the same: a model that runs sequences one by one (`per_sequence`, the
deterministic mode's) forwards a segment's shared prefix apart from the rest
(`Segment.prefix`), so the prefix's keys are computed from exactly its own tokens whether
this sequence computes them or a copy brings them, and the rest is one forward of the
same tokens over the same keys either way: bit for bit the same logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from services.inference.model.interface import DeviceLike
from services.inference.model.prefix_lru import PrefixLru


@runtime_checkable
class PrefixCopies(Protocol):
    """A model whose per-slot cache can give a slot's first positions out and take them back."""

    def prefix_bytes(self, length: int) -> int:
        """Bytes of keys and values for `length` positions (every layer)."""
        ...

    def save_prefix(self, cache: Any, slot: int, length: int, device: DeviceLike) -> Any:
        """A copy of `slot`'s first `length` positions, allocated through `device`; MemoryError
        past its budget."""
        ...

    def load_prefix(self, stored: Any, cache: Any, slot: int) -> None:
        """Write a saved copy into `slot`'s first positions."""
        ...

    def release_prefix(self, stored: Any, device: DeviceLike) -> None:
        """Give a saved copy's memory back."""
        ...


@dataclass(eq=False)
class StoredPrefix:
    """One prefix's keys and values (BOS first), the tokens they were computed from, and their size."""

    tokens: tuple[int, ...]
    kv: Any
    nbytes: int


class SlotPrefixStore(PrefixLru[StoredPrefix]):
    """Prefixes by their exact token ids, least recently used first, within `budget_bytes`."""

    def __init__(self, model: PrefixCopies, device: DeviceLike, budget_bytes: int) -> None:
        super().__init__()
        self.model, self.device = model, device
        self.budget_bytes = max(0, int(budget_bytes))
        self.bytes = 0
        self.peak_bytes = 0
        self.refused = 0  # entries not stored: larger than the budget, or refused by the device's

    def load(self, entry: StoredPrefix, cache: Any, slot: int) -> None:
        """Copy `entry` into `slot`'s first positions."""
        self.model.load_prefix(entry.kv, cache, slot)

    def save(self, tokens: tuple[int, ...], cache: Any, slot: int) -> StoredPrefix | None:
        """Store `slot`'s first len(tokens) positions as the entry for `tokens` (its sequence has
        just been prefilled), unless there is one already or it cannot fit."""
        if tokens in self._entries:
            return self._entries[tokens]
        nbytes = self.model.prefix_bytes(len(tokens))
        if nbytes > self.budget_bytes:
            self.refused += 1
            return None
        while self._entries and self.bytes + nbytes > self.budget_bytes:
            self._drop(next(iter(self._entries.values())))
            self.evictions += 1
        try:
            kv = self.model.save_prefix(cache, slot, len(tokens), self.device)
        except MemoryError:
            self.refused += 1
            return None
        entry = self._entries[tokens] = StoredPrefix(tokens, kv, nbytes)
        self.bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        return entry

    def clear(self) -> None:
        """Give every entry's memory back (the engine closes)."""
        for entry in list(self._entries.values()):
            self._drop(entry)

    def _drop(self, entry: StoredPrefix) -> None:
        del self._entries[entry.tokens]
        self.bytes -= entry.nbytes
        self.model.release_prefix(entry.kv, self.device)
