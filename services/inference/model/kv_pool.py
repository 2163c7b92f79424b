"""The KV pool in blocks, and the prefix cache that keeps a shared system prompt's KV once.

A model whose cache is paged (`PagedCache`: the embedded TinyLM's) stores keys and values
in blocks of `block_size` positions, and reads each slot's positions through that slot's
block table. The engine then hands out blocks instead of whole slots:

* **Blocks, reference-counted.** A sequence takes, when it is admitted, every block it
  can ever need (BOS + system + prompt + max_tokens − 1 positions, rounded up to blocks),
  so it never runs out mid-answer and nothing is ever preempted. Each holder of a block
  (a running sequence, a prefix entry) holds one reference; a block is free at zero.
* **Prefix entries.** The whole blocks at the start of a request's shared part (BOS and
  its system prompt, `GenerationRequest.prefix_ids`) become a prefix entry when the first
  request with it is admitted; the entry, keyed by exactly those tokens, holds one
  reference on its blocks. Every later request whose shared part starts with the same
  tokens maps those blocks into its own table: the system prompt's KV is held once,
  however many sequences read it. Once a sequence has been prefilled into them the entry
  is ready, and later requests are prefilled from the first position after it; a request
  admitted before then (the same step) computes the prefix too, writing bit-identical
  values into the same blocks. Only whole blocks are shared, so no sequence ever writes a
  shared block past its prefix (the rest of a system prompt, under one block, is computed
  again by each sequence).
* **Eviction, LRU, under the pool's budget.** The pool never grows. An entry no running
  sequence uses stays cached in blocks that would otherwise be free; when a sequence needs
  more free blocks than there are, the least recently used of those entries are dropped.
  An entry still in use is never dropped (that would free nothing).

Why it always fits: the pool has `slots × blocks_per_slot` blocks, a sequence's table is
at most `blocks_per_slot` long, and every block of an entry in use is in some running
sequence's table; so with fewer than `slots` sequences running, free plus evictable blocks
always cover one more sequence. Admission is still by slot, as before.

Determinism: the embedded model's arithmetic is exact, so a key computed by another
sequence, in another batch, is bit for bit the key this sequence would have computed; the
answer with a shared prefix is the answer without one (a property test holds it to that).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from services.inference.model.prefix_lru import PrefixLru


@runtime_checkable
class PagedCache(Protocol):
    """A model cache whose slots read their positions through block tables (see `KVCache`)."""

    tables: list[list[int]]

    def set_table(self, slot: int, blocks: list[int]) -> None:
        """The blocks `slot` reads its positions through from now on (the engine's KV pool decides)."""
        ...

    @property
    def block_size(self) -> int: ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def block_bytes(self) -> int: ...


class BlockPool:
    """Free blocks and a reference count per block; counts the peak in use (for the bench)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.refs = [0] * count
        self._free = list(range(count - 1, -1, -1))  # pop() hands out the lowest first
        self.peak = 0

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def in_use(self) -> int:
        return self.count - len(self._free)

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"{n} KV blocks asked for, {len(self._free)} free of {self.count}")
        blocks = [self._free.pop() for _ in range(n)]
        for block in blocks:
            self.refs[block] = 1
        self.peak = max(self.peak, self.in_use)
        return blocks

    def share(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            self.refs[block] += 1

    def drop(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self._free.append(block)


@dataclass(eq=False)
class PrefixEntry:
    """Whole blocks of a shared prefix (BOS first), the tokens they hold, and who reads them.

    `ready` once a sequence has been prefilled into them: until then every sequence that
    maps them computes the prefix itself, writing the same values into the same blocks."""

    tokens: tuple[int, ...]
    blocks: list[int]
    users: int = 0  # running sequences whose tables map these blocks
    ready: bool = False


class PrefixCache(PrefixLru[PrefixEntry]):
    """Prefixes by their exact tokens, least recently used first; each entry holds one
    reference on its blocks."""

    def __init__(self, pool: BlockPool) -> None:
        super().__init__()
        self.pool = pool
        self._idle_blocks = 0  # blocks of entries no running sequence uses

    def add(self, tokens: tuple[int, ...], blocks: Sequence[int]) -> PrefixEntry:
        """A new entry for `tokens` in `blocks` (not ready: nothing is computed yet), used by
        the sequence that brought them."""
        self.pool.share(blocks)
        entry = self._entries[tokens] = PrefixEntry(tokens, list(blocks), users=1)
        return entry

    def enter(self, entry: PrefixEntry) -> None:
        """One more running sequence reads `entry`."""
        if entry.users == 0:
            self._idle_blocks -= len(entry.blocks)
        entry.users += 1

    def leave(self, entry: PrefixEntry) -> None:
        """One running sequence fewer reads `entry`."""
        entry.users -= 1
        if entry.users == 0:
            self._idle_blocks += len(entry.blocks)

    def remove(self, entry: PrefixEntry) -> None:
        if self._entries.get(entry.tokens) is entry:
            del self._entries[entry.tokens]
            self.pool.drop(entry.blocks)
            if entry.users == 0:
                self._idle_blocks -= len(entry.blocks)

    def make_room(self, needed: int) -> None:
        """Drop unused entries, least recently used first, until `needed` blocks are free."""
        for entry in list(self._entries.values()):
            if self.pool.free >= needed:
                return
            if entry.users == 0:
                self.remove(entry)
                self.evictions += 1

    def cached_blocks(self) -> int:
        """Blocks held only by the cache (entries no running sequence uses): free on demand."""
        return self._idle_blocks


@dataclass
class Grant:
    """What a sequence got at admission: its block table, the positions it reads from a
    ready prefix entry (`cached`), and the entry whose blocks its table maps."""

    blocks: list[int]
    cached: int = 0
    entry: PrefixEntry | None = None


class PagedKV:
    """The engine's side of a paged cache: block tables per slot, the pool, the prefix cache."""

    def __init__(self, cache: Any, prefix_caching: bool = True) -> None:
        self.cache: PagedCache = cache
        self.block_size = cache.block_size
        self.pool = BlockPool(cache.num_blocks)
        self.prefixes = PrefixCache(self.pool)
        self.prefix_caching = prefix_caching
        self.peak_used = 0  # most blocks running sequences held at once (cached prefixes aside)

    def admit(self, slot: int, tokens: Sequence[int], shared: int, positions: int) -> Grant:
        """Blocks for a sequence fed `tokens` (BOS first) whose first `shared` tokens may be
        shared, writing `positions` positions in all; MemoryError when they cannot fit."""
        size = self.block_size
        aligned = (min(shared, len(tokens) - 1) // size) * size if self.prefix_caching else 0
        key = tuple(tokens[:aligned])
        entry = self.prefixes.lookup(key) if aligned else None
        reused = len(entry.blocks) if entry is not None else 0
        own = -(-positions // size) - reused
        if entry is not None:
            self.prefixes.enter(entry)  # before making room: the entry it reads must stay
        if self.pool.free < own:
            self.prefixes.make_room(own)
        try:
            blocks = self.pool.take(own)
        except MemoryError:
            if entry is not None:
                self._leave(entry)
            raise
        if entry is not None:
            self.pool.share(entry.blocks)
            blocks = [*entry.blocks, *blocks]
        elif aligned:  # the first with this prefix: its blocks become the entry's
            entry = self.prefixes.add(key, blocks[: aligned // size])
        self.cache.set_table(slot, blocks)
        self.peak_used = max(self.peak_used, self.used_blocks)
        cached = reused * size if entry is not None and entry.ready else 0
        return Grant(blocks, cached, entry)

    def prefilled(self, grant: Grant) -> None:
        """The sequence's first step ran: the prefix in its blocks is computed."""
        if grant.entry is not None:
            grant.entry.ready = True

    def release(self, grant: Grant) -> None:
        """The sequence ended: its references go; blocks nobody else holds are free again."""
        self.pool.drop(grant.blocks)
        if grant.entry is not None:
            self._leave(grant.entry)
        grant.blocks = []
        grant.entry = None

    def _leave(self, entry: PrefixEntry) -> None:
        self.prefixes.leave(entry)
        if entry.users == 0 and not entry.ready:  # never computed (its sequences all failed)
            self.prefixes.remove(entry)

    @property
    def used_blocks(self) -> int:
        """Blocks running sequences hold (a prefix they share counted once)."""
        return self.pool.in_use - self.prefixes.cached_blocks()

    def usage(self) -> dict[str, int]:
        """Blocks by state: used (by running sequences), cached (unused prefixes), free."""
        cached = self.prefixes.cached_blocks()
        return {"used": self.pool.in_use - cached, "cached": cached, "free": self.pool.free}
