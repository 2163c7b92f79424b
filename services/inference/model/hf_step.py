"""A transformers causal LM as a `StepModel`: its KV cache in the engine's slot pool.

The pool holds, per layer, keys and values for every slot at their true positions:
[slots, kv_heads, max_context, head_dim] each, allocated through the device state (so
charged to its budget as `inference.kv_cache`) when the engine is made and never resized.
A step hands the model a `SlotPoolCache` — a `DynamicCache` whose `update` writes the
step's new keys and values into their slots and gives the attention back each sequence's
own keys — so the model's code runs unchanged and nothing is copied into or out of a
per-request cache.

Two ways to run a step:

* **batched** (the default): one forward for every decoding sequence and one for every
  new prompt (so a long prompt does not pad the decoding rows). New tokens are left-padded
  to a common length (so every row's last token is the last column: one row of logits
  each); an explicit 4-D mask lets a token see only its own sequence's keys up to its own
  position, and pad tokens see position 0 alone. Float kernels may sum in another order
  for another batch shape, so a sequence's logits can differ in the last bits with its
  batch mates — rarely its tokens.
* **per sequence** (`batch_invariant`, on by default in deterministic mode): one forward
  per segment, on exactly that sequence's keys (a view of its slot), no padding. What a
  sequence computes then depends on nothing but its own tokens, so its answer is bit for
  bit the same alone, in any batch, and in every layout (same shapes, same kernels). A
  segment that starts with a shared prefix (a system prompt) forwards it first on its
  own, so the answer is also the same whether the prefix's KV was computed here or
  copied in from an earlier request (`kv_prefix`).

A shared prefix's KV is kept out of the pool as plain per-layer tensors allocated through
the device state, not as a transformers `DynamicCache`: in transformers 4.57 a
`DynamicLayer` takes its tensors by `torch.cat` onto an empty one, a copy the device
budget would not see, and what the model reads is the slot pool anyway.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from services.inference.model.interface import DeviceLike, ModelSizes, Segment, allocate, release


@dataclass(frozen=True)
class LayerShape:
    """What one layer's cache holds per token: [kv_heads, head_dim] keys and values."""

    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int

    def bytes_per_token(self, element_size: int) -> int:
        return (self.key_heads * self.key_dim + self.value_heads * self.value_dim) * element_size


@dataclass
class SlotPool:
    """Keys and values per layer: [slots, kv_heads, max_context, head_dim] (the HF layout)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    max_context: int

    @property
    def slots(self) -> int:
        return int(self.keys[0].shape[0]) if self.keys else 0


class SlotPoolCache(DynamicCache):
    """One step's view of the pool, as the model's attention layers expect a cache to behave.

    `update` stores the new keys and values of real (non-pad) tokens at (slot, position)
    and returns, for each row, its slot's keys up to `span`: a view when the step is one
    unpadded sequence, else one gather per layer.
    """

    def __init__(self, pool: SlotPool, plan: _StepPlan) -> None:
        super().__init__()
        self.pool, self.plan = pool, plan

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values, plan = self.pool.keys[layer_idx], self.pool.values[layer_idx], self.plan
        if plan.single is not None:
            slot, start, end = plan.single
            keys[slot, :, start:end] = key_states[0]
            values[slot, :, start:end] = value_states[0]
            return keys[slot:slot + 1, :, :end], values[slot:slot + 1, :, :end]
        keys[plan.write_slots, :, plan.write_positions] = key_states[plan.write_rows, :, plan.write_columns]
        values[plan.write_slots, :, plan.write_positions] = value_states[plan.write_rows, :, plan.write_columns]
        return keys[:, :, :plan.span].index_select(0, plan.slots), values[:, :, :plan.span].index_select(0, plan.slots)

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return 0  # positions are given explicitly; nothing may infer them from the cache


class _ShapeProbe(DynamicCache):
    """Records the shape and dtype of what each layer would cache (one forward of one token)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[int, tuple[LayerShape, torch.dtype]] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        shape = LayerShape(int(key_states.shape[1]), int(key_states.shape[-1]),
                           int(value_states.shape[1]), int(value_states.shape[-1]))
        self.seen[layer_idx] = (shape, key_states.dtype)
        return key_states, value_states


@dataclass(frozen=True)
class _StepPlan:
    """Where one step's tokens sit: the padded batch, and where each real token's keys go."""

    slots: torch.Tensor                   # [B] slot of each row
    span: int                             # keys each row's attention reads (the longest end)
    write_rows: torch.Tensor              # [N] row and column of each real token ...
    write_columns: torch.Tensor
    write_slots: torch.Tensor             # ... and the slot and position its keys go to
    write_positions: torch.Tensor
    single: tuple[int, int, int] | None   # (slot, start, end) for one unpadded sequence


class HFStepModel(ModelSizes):
    """The engine-facing side of a transformers `*ForCausalLM` (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, *, tokenizer_size: int, max_context: int,
                 batch_invariant: bool | None = None) -> None:
        self.module = module.eval()
        self._max_context = max_context
        self.batch_invariant = batch_invariant
        self._keep_last = "logits_to_keep" in inspect.signature(module.forward).parameters
        self.layers, self.kv_dtype, self._vocab_size = self._probe()
        # Logits past the tokenizer's ids (an embedding padded to a round size) are never chosen.
        self._usable_vocab = min(self._vocab_size, tokenizer_size)

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    @property
    def per_sequence(self) -> bool:
        """One forward per sequence: asked for, or (unset) whenever torch runs deterministically."""
        if self.batch_invariant is None:
            return torch.are_deterministic_algorithms_enabled()
        return self.batch_invariant

    def to(self, device: torch.device) -> HFStepModel:
        self.module.to(device)
        return self

    # -- the StepModel contract -------------------------------------------------------
    def kv_bytes_per_slot(self, max_context: int) -> int:
        """Σ over layers of (kv_heads × head_dim for keys + for values) × max_len × dtype size."""
        size = torch.empty((), dtype=self.kv_dtype).element_size()
        return sum(shape.bytes_per_token(size) for shape in self.layers.values()) * max_context

    def new_cache(self, slots: int, max_context: int, device: DeviceLike) -> SlotPool:
        if max_context > self._max_context:
            raise ValueError(f"max_context {max_context} exceeds the model's {self._max_context}")
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        try:
            for layer in range(max(self.layers) + 1):
                shape = self.layers.get(layer, LayerShape(0, 0, 0, 0))
                keys.append(allocate(device, (slots, shape.key_heads, max_context, shape.key_dim), self.kv_dtype))
                values.append(allocate(device, (slots, shape.value_heads, max_context, shape.value_dim),
                                       self.kv_dtype))
        except BaseException:
            for tensor in (*keys, *values):
                release(device, tensor)
            raise
        return SlotPool(keys, values, max_context)

    def release_cache(self, cache: SlotPool, device: DeviceLike) -> None:
        for tensor in (*cache.keys, *cache.values):
            release(device, tensor)
        cache.keys, cache.values = [], []

    @torch.inference_mode()
    def step(self, segments: Sequence[Segment], cache: SlotPool) -> torch.Tensor:
        if not segments:
            return torch.empty(0, self._vocab_size, dtype=torch.float32)
        for seg in segments:
            if not seg.token_ids or seg.end > cache.max_context:
                raise ValueError(f"segment for slot {seg.slot} spans {seg.start}..{seg.end}; "
                                 f"needs 1..{cache.max_context}")
        if self.per_sequence:
            return torch.cat([self._forward_alone(seg, cache) for seg in segments])
        if len(segments) == 1:
            return self._forward(segments, cache)
        # Decoding sequences (one new token each) apart from prompts: a long prompt must not
        # pad every decoding row to its length.
        decoding = [i for i, seg in enumerate(segments) if len(seg.token_ids) == 1]
        prompts = [i for i, seg in enumerate(segments) if len(seg.token_ids) > 1]
        if not decoding or not prompts:
            return self._forward(segments, cache)
        logits = torch.empty((len(segments), self._vocab_size), dtype=torch.float32, device=self.device)
        for group in (decoding, prompts):
            logits[group] = self._forward([segments[i] for i in group], cache)
        return logits

    # -- a shared prefix's KV, kept apart from the pool (`kv_prefix`) ---------------------
    def prefix_bytes(self, length: int) -> int:
        return self.kv_bytes_per_slot(length)

    def save_prefix(self, cache: SlotPool, slot: int, length: int, device: DeviceLike) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, a copy of `slot`'s keys and values at positions 0..length-1, allocated
        through `device` (charged to the KV cache's owner, as the pool is)."""
        saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        try:
            for keys, values in zip(cache.keys, cache.values, strict=True):
                key = allocate(device, (keys.shape[1], length, keys.shape[3]), keys.dtype)
                try:
                    value = allocate(device, (values.shape[1], length, values.shape[3]), values.dtype)
                except BaseException:
                    release(device, key)
                    raise
                saved.append((key, value))
                key.copy_(keys[slot, :, :length])
                value.copy_(values[slot, :, :length])
        except BaseException:
            self.release_prefix(saved, device)
            raise
        return saved

    def load_prefix(self, stored: list[tuple[torch.Tensor, torch.Tensor]], cache: SlotPool, slot: int) -> None:
        for (key, value), keys, values in zip(stored, cache.keys, cache.values, strict=True):
            keys[slot, :, :key.shape[1]].copy_(key)
            values[slot, :, :value.shape[1]].copy_(value)

    def release_prefix(self, stored: list[tuple[torch.Tensor, torch.Tensor]], device: DeviceLike) -> None:
        for key, value in stored:
            release(device, key)
            release(device, value)
        stored.clear()

    # -- one forward ------------------------------------------------------------------
    def _forward_alone(self, seg: Segment, cache: SlotPool) -> torch.Tensor:
        """One sequence's segment on its own; a shared prefix at its start in a forward of its
        own first, so that its keys are the same whether computed here or copied from an
        earlier sequence (`kv_prefix`), and so is what the rest of the segment computes."""
        if 0 < seg.prefix < len(seg.token_ids):
            self._forward([Segment(seg.slot, seg.start, seg.token_ids[:seg.prefix])], cache)
            seg = Segment(seg.slot, seg.start + seg.prefix, seg.token_ids[seg.prefix:])
        return self._forward([seg], cache)

    def _forward(self, segments: Sequence[Segment], cache: SlotPool) -> torch.Tensor:
        dev = self.device
        width = max(len(seg.token_ids) for seg in segments)
        ids = torch.zeros((len(segments), width), dtype=torch.long)
        positions = torch.zeros((len(segments), width), dtype=torch.long)
        real = torch.zeros((len(segments), width), dtype=torch.bool)
        for row, seg in enumerate(segments):
            pad = width - len(seg.token_ids)
            ids[row, pad:] = torch.tensor(seg.token_ids, dtype=torch.long)
            positions[row, pad:] = torch.arange(seg.start, seg.end)
            real[row, pad:] = True
        span = max(seg.end for seg in segments)
        rows, columns = real.nonzero(as_tuple=True)
        slots = torch.tensor([seg.slot for seg in segments], dtype=torch.long)
        single = None
        if len(segments) == 1:
            single = (segments[0].slot, segments[0].start, segments[0].end)
        plan = _StepPlan(slots=slots.to(dev), span=span, write_rows=rows.to(dev), write_columns=columns.to(dev),
                         write_slots=slots[rows].to(dev), write_positions=positions[rows, columns].to(dev),
                         single=single)
        # A real token at position p sees keys 0..p of its own slot; a pad token sees key 0 alone
        # (some key, so that its row stays finite; its output is never used or stored).
        key_positions = torch.arange(span).view(1, 1, span)
        visible = torch.where(real.unsqueeze(-1), key_positions <= positions.unsqueeze(-1), key_positions == 0)
        dtype = self.kv_dtype
        mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
        extra = {"logits_to_keep": 1} if self._keep_last else {}
        out = self.module(input_ids=ids.to(dev), position_ids=positions.to(dev),
                          attention_mask=mask.unsqueeze(1).to(dev), past_key_values=SlotPoolCache(cache, plan),
                          use_cache=True, cache_position=torch.arange(width, device=dev), **extra)
        logits: torch.Tensor = out.logits[:, -1, :].float()
        if self._usable_vocab < self._vocab_size:
            logits[:, self._usable_vocab:] = -torch.inf
        return logits

    def _probe(self) -> tuple[dict[int, LayerShape], torch.dtype, int]:
        """Per layer, what the model caches (one forward of one token): heads, head size, dtype;
        and the width of its logits (the vocabulary the engine samples from)."""
        probe = _ShapeProbe()
        with torch.inference_mode():
            out = self.module(input_ids=torch.zeros((1, 1), dtype=torch.long, device=self.device),
                              past_key_values=probe, use_cache=True)
        if not probe.seen:
            raise ValueError("the model cached no keys or values in a forward: not a decoder with a KV cache")
        dtypes = {dtype for _, dtype in probe.seen.values()}
        if len(dtypes) != 1:
            raise ValueError(f"the model caches keys in several dtypes ({sorted(map(str, dtypes))})")
        return {layer: shape for layer, (shape, _) in probe.seen.items()}, dtypes.pop(), int(out.logits.shape[-1])
