"""The tiny model's KV cache: keys and values in blocks of positions, and one forward's paging.

The cache is what the engine's KV pool (`kv_pool.py`) hands out by the block; the paging
is how one forward of `TinyLM` finds, from the slots' block tables, where each new token's
keys go and which blocks each segment reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.inference.model.interface import Segment

KV_BLOCK_TOKENS = 16  # positions per KV block: the unit a shared prefix is kept in


@dataclass
class KVCache:
    """Keys and values in blocks of positions: [layers, blocks, block_size, heads, head_dim].

    `tables[slot]` lists the blocks holding that slot's positions 0, 1, …: position p is at
    block `tables[slot][p // block_size]`, row `p % block_size`. A new cache gives each slot
    blocks of its own (slot s: blocks s×n … s×n+n−1), which behaves as one region per slot;
    the engine may rewrite a slot's table, so that sequences with the same prefix read the
    same blocks (`services.inference.model.kv_pool`). Positions past a sequence's end may map to any
    block: attention masks them to an exact 0.

    Stored as float32: the values sit on a grid of at most 16 significant bits, so the
    narrower type holds them exactly at half the memory.
    """

    keys: torch.Tensor
    values: torch.Tensor
    tables: list[list[int]]
    max_context: int

    @property
    def slots(self) -> int:
        return len(self.tables)

    def set_table(self, slot: int, blocks: list[int]) -> None:
        self.tables[slot] = blocks

    @property
    def block_size(self) -> int:
        return int(self.keys.shape[2])

    @property
    def num_blocks(self) -> int:
        return int(self.keys.shape[1])

    @property
    def block_bytes(self) -> int:
        """Keys and values of one block, all layers."""
        per_block = self.keys[:, 0].numel() * self.keys.element_size()
        return 2 * per_block


def block_size_for(max_context: int) -> int:
    """Positions per KV block: KV_BLOCK_TOKENS, or the whole context when it is shorter."""
    return max(1, min(KV_BLOCK_TOKENS, max_context))


def blocks_per_slot(max_context: int) -> int:
    return -(-max_context // block_size_for(max_context))


def segment_offsets(segments: Sequence[Segment]) -> list[int]:
    offsets, total = [], 0
    for seg in segments:
        offsets.append(total)
        total += len(seg.token_ids)
    return offsets


def last_indices(segments: Sequence[Segment]) -> list[int]:
    return [o + len(s.token_ids) - 1 for o, s in zip(segment_offsets(segments), segments, strict=True)]


@dataclass(frozen=True)
class Paging:
    """Where one forward's keys go and which blocks each segment reads: worked out once per
    forward from the slots' block tables, used by every layer."""

    write_blocks: torch.Tensor  # [N] block of each new token ...
    write_rows: torch.Tensor  # ... and its row in the block
    single_rows: torch.Tensor | None  # rows of the one-token segments in the packed batch
    single_tables: torch.Tensor | None  # [G, blocks] what each of them reads (padded: masked anyway)
    single_span: int
    prompt_tables: dict[int, torch.Tensor]  # segment index -> the blocks a longer segment reads

    @classmethod
    def of(cls, segments: Sequence[Segment], cache: KVCache, device: torch.device) -> Paging:
        size, tables = cache.block_size, cache.tables
        blocks, rows = [], []
        for seg in segments:
            table = tables[seg.slot]
            for p in range(seg.start, seg.end):
                blocks.append(table[p // size])
                rows.append(p % size)
        singles = [i for i, s in enumerate(segments) if len(s.token_ids) == 1]
        single_rows = single_tables = None
        span = 0
        if singles:
            span = max(segments[i].end for i in singles)
            width = -(-span // size)
            padded = [(tables[segments[i].slot][:width] + [0] * width)[:width] for i in singles]
            offsets = segment_offsets(segments)
            single_rows = torch.tensor([offsets[i] for i in singles], dtype=torch.long, device=device)
            single_tables = torch.tensor(padded, dtype=torch.long, device=device)
        prompts = {
            i: torch.tensor(tables[s.slot][: -(-s.end // size)], dtype=torch.long, device=device)
            for i, s in enumerate(segments) if len(s.token_ids) > 1
        }
        return cls(torch.tensor(blocks, dtype=torch.long, device=device),
                   torch.tensor(rows, dtype=torch.long, device=device),
                   single_rows, single_tables, span, prompts)
