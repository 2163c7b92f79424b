"""The embedded default model: a tiny decoder-only transformer whose arithmetic is exact.

Why exact: spine promises that a request's tokens do not depend on what it is batched
with. Ordinary float kernels break that promise in the last bits — a batched matmul may sum
in another order than an unbatched one, and an elementwise kernel may use a vector path
for some positions and a scalar path for the tail — and one flipped bit can flip an
argmax. Rounding logits only makes flips rare. Instead, this model computes on a
fixed-point grid held in float64, so that every sum is exact and order cannot matter:

* Weights are integers times 2**-14 with |w| <= 1, drawn with `torch.randint` from a
  local generator: identical bits on every machine, no transcendental functions.
* Before each matmul the activations are rounded to a grid and clamped (`_fix`), so every
  product and every partial sum is an integer multiple of one power of two below 2**53:
  float64 adds them exactly in any order, on any BLAS, CPU or GPU. In units of the grid:
  activations <= 2**22, weights <= 2**14, so a matmul over K <= 2**16 terms stays below
  2**53; x² <= 2**44 summed over d_model <= 2**9; attention weights <= 2**20 times values
  <= 2**16 over <= 2**16 keys. `__init__` refuses dimensions beyond these budgets.
* The non-linear parts use only IEEE operations that are correctly rounded, hence give the
  same bits for the same inputs wherever they run: + - * / sqrt, round, max, ReLU.
* Softmax needs exp, whose vector and scalar implementations differ in the last bit; it is
  replaced by a lookup table of exp on a 1/32 grid, itself rounded to 2**-20. Masked keys
  look up an exact 0, so padding and a slot's stale contents add exactly nothing.

The result: the logits of a sequence are bit-identical alone or in any batch, on the CPU
and on CUDA. The cost is a few cheap elementwise ops per layer.

So that the output looks like text, the model's logits are scaled down and added to a
prior of English byte frequencies; bytes outside 32..126 and '\\n' get -inf, and EOS a
small log-probability (`eos_logprob`), so that some sampled answers end with "stop".
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from services.inference.model.interface import DeviceLike, ModelSizes, Segment, allocate, release
from services.inference.model.tiny_kv import (
    KVCache,
    Paging,
    block_size_for,
    blocks_per_slot,
    last_indices,
    segment_offsets,
)
from services.inference.model.tokenizer import EOS_ID, VOCAB_SIZE

WEIGHT_BITS = 14
ACT_BITS, ACT_LIMIT = 16, 64.0  # residual stream, normalised inputs, MLP hidden
QK_BITS, QK_LIMIT = 8, 32.0
V_BITS, V_LIMIT = 12, 16.0
OUT_LIMIT = 16.0  # attention output before its projection
PROB_BITS = 20
EXP_STEPS_PER_UNIT = 32
EXP_TABLE_UNITS = 16  # exp(-16) rounds to 0 at 2**-20
NORM_EPS = 2.0**-8
MAX_D_MODEL = 1 << 9  # RMSNorm: x² <= 2**44 grid units, 2**9 of them
MAX_D_FF = 1 << 16  # matmul: 2**22 * 2**14 per product, 2**16 of them, plus the residual
MAX_CONTEXT_LIMIT = 1 << 16  # attention sum: 21 + 16 + 16 bits = 53
PREFILL_QUERY_CHUNK = 128  # bounds a long prompt's score matrix to chunk x context

PRINTABLE = [*range(32, 127), ord("\n")]


def _fix(x: torch.Tensor, bits: int, limit: float) -> torch.Tensor:
    """Round to a multiple of 2**-bits and clamp to ±limit (exact ops, any device)."""
    scale = float(1 << bits)
    return torch.round(x * scale).clamp_(-limit * scale, limit * scale).mul_(1.0 / scale)


def _grid_uniform(gen: torch.Generator, shape: tuple[int, ...], bound: float) -> torch.Tensor:
    """Integers in ±bound * 2**WEIGHT_BITS, as float64 multiples of 2**-WEIGHT_BITS."""
    top = max(1, int(bound * (1 << WEIGHT_BITS)))
    ints = torch.randint(-top, top + 1, shape, generator=gen, dtype=torch.int64)
    return ints.to(torch.float64) / float(1 << WEIGHT_BITS)


class TinyLM(ModelSizes, torch.nn.Module):
    """Decoder-only transformer (pre-RMSNorm, ReLU MLP, learned positions, untied head).

    Weight matrices are stored [in, out], so a matmul needs no transposed view.

    The head is untied because with random weights a tied one mostly echoes the input
    token (its own embedding scores highest), and the answers become one repeated byte.
    """

    embed: torch.Tensor
    pos: torch.Tensor
    head: torch.Tensor
    exp_table: torch.Tensor
    logit_bias: torch.Tensor

    def __init__(
        self,
        *,
        d_model: int = 64,
        n_layers: int = 2,
        n_heads: int = 4,
        d_ff: int = 128,
        max_context: int = 1024,
        vocab_size: int = VOCAB_SIZE,
        eos_logprob: float = -5.5,
        logit_scale: float = 0.25,
    ) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be a multiple of n_heads ({n_heads})")
        for name, value, limit in (
            ("d_model", d_model, MAX_D_MODEL),
            ("d_ff", d_ff, MAX_D_FF),
            ("max_context", max_context, MAX_CONTEXT_LIMIT),
        ):
            if not 1 <= value <= limit:
                raise ValueError(f"{name} must be in 1..{limit} for exact arithmetic, got {value}")
        if vocab_size <= EOS_ID:
            raise ValueError(f"vocab_size must be > {EOS_ID} (the EOS id), got {vocab_size}")
        self.d_model, self.n_layers, self.n_heads, self.d_ff = d_model, n_layers, n_heads, d_ff
        self.head_dim = d_model // n_heads
        self._max_context, self._vocab_size = max_context, vocab_size
        # Index scale of the exp table: (max - score) / sqrt(head_dim) in table steps.
        self._logit_scale = logit_scale
        self._exp_index_scale = EXP_STEPS_PER_UNIT / math.sqrt(self.head_dim)
        self.register_buffer("embed", torch.zeros(vocab_size, d_model, dtype=torch.float64))
        self.register_buffer("pos", torch.zeros(max_context, d_model, dtype=torch.float64))
        self.register_buffer("head", torch.zeros(d_model, vocab_size, dtype=torch.float64))
        for i in range(n_layers):
            self.register_buffer(f"wqkv{i}", torch.zeros(d_model, 3 * d_model, dtype=torch.float64))
            self.register_buffer(f"wo{i}", torch.zeros(d_model, d_model, dtype=torch.float64))
            self.register_buffer(f"w1_{i}", torch.zeros(d_model, d_ff, dtype=torch.float64))
            self.register_buffer(f"w2_{i}", torch.zeros(d_ff, d_model, dtype=torch.float64))
        self.register_buffer("exp_table", _exp_table(), persistent=False)
        self.register_buffer("logit_bias", _logit_bias(vocab_size, eos_logprob), persistent=False)

    @classmethod
    def from_seed(cls, seed: int, **dims: int | float) -> TinyLM:
        """The model for `seed`: the same weights, bit for bit, in every process."""
        model = cls(**dims)  # type: ignore[arg-type]
        gen = torch.Generator(device="cpu").manual_seed(int(seed))
        d, ff = model.d_model, model.d_ff
        weights = {"embed": _grid_uniform(gen, (model._vocab_size, d), 1.0)}
        weights["pos"] = _grid_uniform(gen, (model._max_context, d), 0.5)
        for i in range(model.n_layers):
            weights[f"wqkv{i}"] = _grid_uniform(gen, (d, 3 * d), math.sqrt(3.0 / d))
            weights[f"wo{i}"] = _grid_uniform(gen, (d, d), math.sqrt(3.0 / d))
            weights[f"w1_{i}"] = _grid_uniform(gen, (d, ff), math.sqrt(6.0 / d))
            weights[f"w2_{i}"] = _grid_uniform(gen, (ff, d), math.sqrt(3.0 / ff))
        weights["head"] = _grid_uniform(gen, (d, model._vocab_size), 1.0)
        with torch.no_grad():
            for name, tensor in weights.items():
                getattr(model, name).copy_(tensor)
        return model

    @property
    def device(self) -> torch.device:
        return self.embed.device

    # -- the StepModel contract -------------------------------------------------------

    def new_cache(self, slots: int, max_context: int, device: DeviceLike) -> KVCache:
        if max_context > self._max_context:
            raise ValueError(f"max_context {max_context} exceeds the model's {self._max_context}")
        size, per_slot = block_size_for(max_context), blocks_per_slot(max_context)
        shape = (self.n_layers, slots * per_slot, size, self.n_heads, self.head_dim)
        tables = [list(range(slot * per_slot, (slot + 1) * per_slot)) for slot in range(slots)]
        keys = allocate(device, shape, torch.float32)
        return KVCache(keys, allocate(device, shape, torch.float32), tables, max_context)

    def kv_bytes_per_slot(self, max_context: int) -> int:
        """Bytes one slot of `new_cache` takes: 2 × layers × heads × head_dim × max_len × 4 (float32),
        max_len rounded up to whole blocks."""
        positions = blocks_per_slot(max_context) * block_size_for(max_context)
        return 2 * self.n_layers * self.n_heads * self.head_dim * positions * 4

    def release_cache(self, cache: KVCache, device: DeviceLike) -> None:
        release(device, cache.keys)
        release(device, cache.values)

    def step(self, segments: Sequence[Segment], cache: KVCache) -> torch.Tensor:
        return self.forward(segments, cache)

    # -- forward ------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self, segments: Sequence[Segment], cache: KVCache | None = None, *, all_logits: bool = False
    ) -> torch.Tensor:
        """Logits [S, V] after each segment's last token ([N, V] for every token with `all_logits`).

        The segments are packed into one [N, d] batch for every matmul; attention reads
        each sequence's own slot. Without a cache there must be one segment starting at 0,
        and attention uses its own keys: the reference the cached path is tested against.
        """
        if not segments:
            return torch.empty(0, self._vocab_size, dtype=torch.float64, device=self.device)
        if cache is None and (len(segments) != 1 or segments[0].start != 0):
            raise ValueError("without a cache, forward takes one segment starting at position 0")
        limit = cache.max_context if cache is not None else self._max_context
        for seg in segments:
            if not seg.token_ids or seg.end > limit:
                raise ValueError(
                    f"segment for slot {seg.slot} spans {seg.start}..{seg.end}; needs 1..{limit}"
                )
        dev = self.device
        tokens = torch.tensor([t for s in segments for t in s.token_ids], dtype=torch.long, device=dev)
        positions = torch.tensor(
            [p for s in segments for p in range(s.start, s.end)], dtype=torch.long, device=dev
        )
        paging = Paging.of(segments, cache, dev) if cache is not None else None
        x = self.embed[tokens] + self.pos[positions]
        for layer in range(self.n_layers):
            x = self._block(layer, x, segments, positions, paging, cache)
        if not all_logits:
            last = torch.tensor(last_indices(segments), dtype=torch.long, device=dev)
            x = x[last]
        h = _fix(_rms_norm(x), ACT_BITS, ACT_LIMIT)
        return (h @ self.head) * self._logit_scale + self.logit_bias

    def _block(
        self,
        layer: int,
        x: torch.Tensor,
        segments: Sequence[Segment],
        positions: torch.Tensor,
        paging: Paging | None,
        cache: KVCache | None,
    ) -> torch.Tensor:
        n, d, heads, hd = x.shape[0], self.d_model, self.n_heads, self.head_dim
        h = _fix(_rms_norm(x), ACT_BITS, ACT_LIMIT)
        qkv = h @ getattr(self, f"wqkv{layer}")
        q = _fix(qkv[:, :d], QK_BITS, QK_LIMIT).view(n, heads, hd)
        k = _fix(qkv[:, d : 2 * d], QK_BITS, QK_LIMIT).view(n, heads, hd)
        v = _fix(qkv[:, 2 * d :], V_BITS, V_LIMIT).view(n, heads, hd)
        if cache is None or paging is None:
            out = self._attend(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), positions.unsqueeze(0))[0]
        else:
            where = (paging.write_blocks, paging.write_rows)
            cache.keys[layer].index_put_(where, k.to(torch.float32))
            cache.values[layer].index_put_(where, v.to(torch.float32))
            out = self._attend_cached(layer, q, positions, segments, cache, paging)
        o = _fix(out.reshape(n, d), ACT_BITS, OUT_LIMIT)
        x = _fix(x + o @ getattr(self, f"wo{layer}"), ACT_BITS, ACT_LIMIT)
        h = _fix(_rms_norm(x), ACT_BITS, ACT_LIMIT)
        hidden = _fix(torch.relu(h @ getattr(self, f"w1_{layer}")), ACT_BITS, ACT_LIMIT)
        return _fix(x + hidden @ getattr(self, f"w2_{layer}"), ACT_BITS, ACT_LIMIT)

    def _attend_cached(
        self,
        layer: int,
        q: torch.Tensor,
        positions: torch.Tensor,
        segments: Sequence[Segment],
        cache: KVCache,
        paging: Paging,
    ) -> torch.Tensor:
        """Attention of every new token over its slot's blocks: single-token segments together,
        prompts alone.

        Grouping is free to change (the sums are exact); it only bounds memory: a long
        prompt must not pad every decoding sequence's score matrix to its length. Where a
        key sits (which block, shared or not) cannot change a sum either.
        """
        out = torch.empty_like(q)
        keys, values = cache.keys[layer], cache.values[layer]
        heads, hd = self.n_heads, self.head_dim
        offsets = segment_offsets(segments)
        if paging.single_rows is not None and paging.single_tables is not None:
            rows, tables, span = paging.single_rows, paging.single_tables, paging.single_span
            group = tables.shape[0]
            out[rows] = self._attend(
                q[rows].unsqueeze(1),
                keys[tables].reshape(group, -1, heads, hd)[:, :span].to(torch.float64),
                values[tables].reshape(group, -1, heads, hd)[:, :span].to(torch.float64),
                positions[rows].unsqueeze(1),
            ).squeeze(1)
        for i, blocks in paging.prompt_tables.items():
            seg = segments[i]
            k = keys[blocks].reshape(-1, heads, hd)[: seg.end].to(torch.float64).unsqueeze(0)
            v = values[blocks].reshape(-1, heads, hd)[: seg.end].to(torch.float64).unsqueeze(0)
            for lo in range(0, len(seg.token_ids), PREFILL_QUERY_CHUNK):
                a = offsets[i] + lo
                b = offsets[i] + min(len(seg.token_ids), lo + PREFILL_QUERY_CHUNK)
                out[a:b] = self._attend(q[a:b].unsqueeze(0), k, v, positions[a:b].unsqueeze(0))[0]
        return out

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: torch.Tensor) -> torch.Tensor:
        """Causal attention. q [G,T,H,hd]; k, v [G,L,H,hd]; qpos [G,T] → [G,T,H,hd].

        Key j is visible to a query at position p when j <= p. Scores are exact; the
        softmax weights come from the exp table, so only exact sums and one correctly
        rounded division remain.
        """
        qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        scores = qh @ kh.transpose(-1, -2)  # [G,H,T,L]
        key_pos = torch.arange(k.shape[1], device=q.device)
        hidden = (key_pos.view(1, 1, -1) > qpos.unsqueeze(-1)).unsqueeze(1)  # [G,1,T,L]
        scores = scores.masked_fill_(hidden, -math.inf)
        top = scores.amax(dim=-1, keepdim=True)
        steps = ((top - scores) * self._exp_index_scale).round_().clamp_(max=len(self.exp_table) - 1)
        weights = self.exp_table[steps.long()]
        out = (weights @ vh) / weights.sum(dim=-1, keepdim=True)
        return out.transpose(1, 2)


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(mean(x²) + eps): an exact sum, then correctly rounded sqrt and division."""
    mean_square = (x * x).sum(dim=-1, keepdim=True) / x.shape[-1]
    return x / torch.sqrt(mean_square + NORM_EPS)


def _exp_table() -> torch.Tensor:
    """exp(-i/32) rounded to 2**-20 for i in 0..511, then an exact 0 for masked keys."""
    scale = float(1 << PROB_BITS)
    size = EXP_STEPS_PER_UNIT * EXP_TABLE_UNITS
    values = [round(math.exp(-i / EXP_STEPS_PER_UNIT) * scale) / scale for i in range(size)]
    return torch.tensor([*values, 0.0], dtype=torch.float64)


def _logit_bias(vocab_size: int, eos_logprob: float) -> torch.Tensor:
    """A prior over the next byte: log-frequencies of English text, -inf for unprintables.

    Added to the model's (random) logits, it makes answers look like text; EOS gets a small
    log-probability so that some answers end with "stop"; BOS is never produced. Values sit
    on a 2**-8 grid so that adding them keeps the logits exact.
    """
    bias = torch.full((vocab_size,), -math.inf, dtype=torch.float64)
    for byte in PRINTABLE:
        bias[byte] = _quarter_byte(math.log(_BYTE_FREQUENCY.get(chr(byte), 0.0005)))
    for letter, freq in _LETTER_FREQUENCY.items():
        bias[ord(letter)] = _quarter_byte(math.log(freq))
        bias[ord(letter.upper())] = _quarter_byte(math.log(freq / 20))
    bias[EOS_ID] = _quarter_byte(eos_logprob)
    return bias


def _quarter_byte(value: float) -> float:
    return round(value * 256) / 256


_LETTER_FREQUENCY = {
    "e": 0.10, "t": 0.075, "a": 0.065, "o": 0.062, "i": 0.057, "n": 0.057, "s": 0.053,
    "h": 0.049, "r": 0.05, "d": 0.034, "l": 0.033, "c": 0.022, "u": 0.022, "m": 0.02,
    "w": 0.019, "f": 0.018, "g": 0.016, "y": 0.016, "p": 0.015, "b": 0.012, "v": 0.008,
    "k": 0.006, "j": 0.001, "x": 0.0015, "q": 0.001, "z": 0.0007,
}  # fmt: skip
_BYTE_FREQUENCY = {" ": 0.18, ".": 0.01, ",": 0.01, "\n": 0.004, "'": 0.002, "?": 0.001, "!": 0.001}
