"""Prefixes by their exact token ids, least recently used first, with hit and miss counts.

Both KV layouts keep shared prefixes this way: the paged pool as blocks several sequences map
(`kv_pool.PrefixCache`), the slot pool as saved copies written into each slot that reuses one
(`kv_prefix.SlotPrefixStore`). What an entry holds and how it is evicted differ; the lookup,
its counts and the recency order are one piece of code.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

Entry = TypeVar("Entry")


class PrefixLru(Generic[Entry]):
    """An ordered map from a prefix's token ids to its entry; a lookup that finds one makes it
    the most recently used (evict from the front: `oldest`)."""

    def __init__(self) -> None:
        self._entries: OrderedDict[tuple[int, ...], Entry] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, tokens: tuple[int, ...]) -> Entry | None:
        entry = self._entries.get(tokens)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(tokens)
        return entry
