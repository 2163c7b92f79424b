"""Step-level continuous batching over a bounded pool of per-sequence slots.

Each `step()` runs ONE model forward for every active sequence: new sequences bring their
whole prompt (prefill), running ones their last token (decode); sequences join and leave
between any two steps, and a finished or cancelled sequence frees its slot at once.

Batch invariance — a request gets the same tokens alone, in any batch, joining at any
step — rests on two choices:

* the model's logits for a sequence are bit-identical whatever it is batched with (the
  embedded TinyLM computes on an exact fixed-point grid; see `tiny_lm`), and
* token choice happens per sequence on the CPU: greedy is the first argmax of that
  sequence's logits; sampling draws one uniform number per token from the sequence's own
  `torch.Generator` (seeded from the request) and inverts the CDF of softmax(logits/T).
  Nothing a batch mate does touches those logits or that generator, and the choice is
  made on the CPU wherever the model runs, so CUDA and CPU agree too.

A request may name a shared prefix (`prefix_ids`: a system prompt's tokens). Where the
model's cache is paged (the embedded TinyLM's), the engine hands out KV blocks and keeps
such prefixes once, reference-counted, evicted LRU under the pool's size (`kv_pool`): a
sequence whose prefix is cached is prefilled from the end of it. Where the cache is one
region per slot and the model can copy a slot's first positions out and in (a
transformers model's, `hf_step`), the prefix's KV is stored once after its first prefill
and copied into later sequences' slots, evicted LRU under `prefix_budget_bytes`
(`kv_prefix`). Elsewhere the prefix is just the start of the prompt. Either way the model
reads the same tokens at the same positions, so the answer is the same.

The engine is thread-safe: a scheduler thread may call `step()` while request threads
`submit()` and `cancel()`.
"""

from __future__ import annotations

import itertools
import math
import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from services.inference.model.interface import DeviceLike, Segment, StepModel, Tokenizer, torch_device
from services.inference.model.kv_pool import Grant, PagedCache, PagedKV
from services.inference.model.kv_prefix import PrefixCopies, SlotPrefixStore

FinishReason = Literal["length", "stop"]


class SlotsExhausted(RuntimeError):
    """Every slot holds a running sequence; the caller queues or refuses the request."""


@dataclass(frozen=True)
class GenerationRequest:
    """Prompt token ids (no BOS: the engine adds it) and how to continue them.

    `prefix_ids` come before the prompt (BOS, prefix, prompt): a part many requests share,
    such as a system prompt, whose KV the engine keeps once where the cache allows it."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    prefix_ids: Sequence[int] = ()


@dataclass(eq=False)
class SequenceHandle:
    """One submitted sequence. Read its public fields; only the engine changes them.

    `token_ids` are the generated tokens so far (EOS excluded); `finish_reason` is
    "length", "stop" or "cancelled" once it is done; `seed` is the one actually used
    (drawn at random when the request had none and samples); `prompt_tokens` counts the
    prefix and the prompt; `reused_tokens` the positions read from a cached prefix.
    """

    id: int
    slot: int
    seed: int | None
    max_tokens: int
    prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    reused_tokens: int = 0
    _pending: tuple[int, ...] = ()
    _cached: int = 0
    _temperature: float = 0.0
    _generator: torch.Generator | None = None
    _grant: Grant | None = None  # its KV blocks, where the cache is paged
    _prefix: int = 0  # leading tokens of `_pending` that are its shared prefix (a first step)
    _save: tuple[int, ...] | None = None  # the prefix to store after its prefill (`kv_prefix`)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class StepOutput:
    """The token a sequence got in one step; on "stop" the token is EOS (not part of the answer)."""

    handle: SequenceHandle
    token_id: int
    finished: bool
    finish_reason: FinishReason | None


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]
    finish_reason: FinishReason


class GenerationEngine:
    """Runs up to `max_slots` sequences of up to `max_context` tokens (BOS included) at once."""

    def __init__(
        self,
        model: StepModel,
        tokenizer: Tokenizer,
        device: DeviceLike | str,
        max_slots: int,
        max_context: int,
        *,
        prefix_caching: bool = True,
        prefix_budget_bytes: int | None = None,
    ) -> None:
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        if not 2 <= max_context <= model.max_context:
            raise ValueError(
                f"max_context must be in 2..{model.max_context} (the model's), got {max_context}"
            )
        if model.vocab_size != tokenizer.vocab_size:
            raise ValueError(
                f"model vocab_size {model.vocab_size} != tokenizer vocab_size {tokenizer.vocab_size}"
            )
        self.model, self.tokenizer = model, tokenizer
        # What ends an answer: EOS, and any other stop token the tokenizer names (an instruct
        # model's end of turn); the token is not part of the answer.
        self._stop_ids = frozenset({tokenizer.eos_id, *getattr(tokenizer, "stop_ids", ())})
        self.max_slots, self.max_context = max_slots, max_context
        self._device: DeviceLike = torch.device(device) if isinstance(device, str) else device
        move = getattr(model, "to", None)
        if callable(move):
            move(torch_device(self._device))
        self._cache: Any = model.new_cache(max_slots, max_context, self._device)
        # A paged cache: blocks per sequence and shared prefixes (else one region per slot).
        self.kv: PagedKV | None = None
        if isinstance(self._cache, PagedCache):
            self.kv = PagedKV(self._cache, prefix_caching)
        # A slot pool whose model copies prefixes: stored ones, within `prefix_budget_bytes`
        # (default: one slot's KV, room for the longest prefix).
        self.prefixes: SlotPrefixStore | None = None
        if self.kv is None and prefix_caching and isinstance(model, PrefixCopies):
            budget = prefix_budget_bytes if prefix_budget_bytes is not None else model.prefix_bytes(max_context)
            self.prefixes = SlotPrefixStore(model, self._device, budget)
        self._free = list(range(max_slots))
        self._active: dict[int, SequenceHandle] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()

    @property
    def device(self) -> torch.device:
        return torch_device(self._device)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def active_count(self) -> int:
        return len(self._active)

    def submit(self, req: GenerationRequest) -> SequenceHandle:
        """Reserve a slot for `req`; its prompt is prefilled by the next `step()`."""
        self._validate(req)
        seed = req.seed
        if seed is None and req.temperature > 0:
            seed = secrets.randbits(63)
        generator = None
        if req.temperature > 0:
            generator = torch.Generator(device="cpu").manual_seed(int(seed))  # type: ignore[arg-type]
        tokens = (self.tokenizer.bos_id, *req.prefix_ids, *req.prompt_ids)
        with self._lock:
            if not self._free:
                raise SlotsExhausted(
                    f"all {self.max_slots} generation slots are busy; retry when a sequence finishes"
                )
            self._free.sort()
            slot = self._free[0]
            grant = None
            if self.kv is not None:
                try:  # every position it may write: BOS, prefix, prompt and max_tokens - 1
                    grant = self.kv.admit(slot, tokens, 1 + len(req.prefix_ids), len(tokens) - 1 + req.max_tokens)
                except MemoryError as error:  # not expected: see kv_pool (why it always fits)
                    raise SlotsExhausted(f"no room in the KV pool: {error}") from None
            self._free.pop(0)
            cached = grant.cached if grant is not None else 0
            # The shared part a sequence may reuse: BOS and its prefix, short of the last token
            # (a step needs one token to compute the next one's logits).
            shared = min(1 + len(req.prefix_ids), len(tokens) - 1) if req.prefix_ids else 0
            save = None
            if self.prefixes is not None and shared:
                stored = self.prefixes.lookup(tokens[:shared])
                if stored is not None:
                    self.prefixes.load(stored, self._cache, slot)
                    cached = shared
                else:
                    save = tokens[:shared]
            handle = SequenceHandle(
                id=next(self._ids),
                slot=slot,
                seed=seed,
                max_tokens=req.max_tokens,
                prompt_tokens=len(req.prefix_ids) + len(req.prompt_ids),
                reused_tokens=cached,
                _pending=tokens[cached:],
                _cached=cached,
                _temperature=float(req.temperature),
                _generator=generator,
                _grant=grant,
                _prefix=max(0, shared - cached),
                _save=save,
            )
            self._active[handle.id] = handle
        return handle

    def cancel(self, handle: SequenceHandle) -> None:
        """Stop `handle` now and free its slot; it yields no more tokens. Idempotent."""
        with self._lock:
            if self._active.pop(handle.id, None) is not None:
                handle.finish_reason = "cancelled"
                self._release(handle)

    def step(self) -> list[StepOutput]:
        """Advance every active sequence by one token in one batched forward."""
        with self._lock:
            handles = list(self._active.values())
            if not handles:
                return []
            segments = [Segment(h.slot, h._cached, h._pending, h._prefix) for h in handles]
            logits = self.model.step(segments, self._cache).to("cpu", torch.float64)
            outputs = []
            for row, handle in zip(logits, handles, strict=True):
                token = _choose(row, handle._temperature, handle._generator)
                outputs.append(self._advance(handle, token))
            return outputs

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Run `requests` to completion (queued while slots are busy); results in request order."""
        for req in requests:
            self._validate(req)
        waiting = list(enumerate(requests))
        handles: dict[int, SequenceHandle] = {}
        while waiting or any(not h.finished for h in handles.values()):
            while waiting and self.free_slots:
                index, req = waiting.pop(0)
                handles[index] = self.submit(req)
            self.step()
        return [
            GenerationResult(list(handles[i].token_ids), handles[i].finish_reason)  # type: ignore[arg-type]
            for i in range(len(requests))
        ]

    def close(self) -> None:
        """Give the cache's memory back; the engine is unusable afterwards."""
        with self._lock:
            if self.prefixes is not None:
                self.prefixes.clear()
            self.model.release_cache(self._cache, self._device)
            self._cache = None
            self._active.clear()
            self._free = []

    def _advance(self, handle: SequenceHandle, token: int) -> StepOutput:
        if handle._cached == handle.reused_tokens and self.kv is not None and handle._grant is not None:
            self.kv.prefilled(handle._grant)  # its first step ran: the prefix in its blocks is computed
        if handle._save is not None and self.prefixes is not None:  # its prefix is computed: keep it
            self.prefixes.save(handle._save, self._cache, handle.slot)
            handle._save = None
        handle._prefix = 0
        handle._cached += len(handle._pending)
        reason: FinishReason | None = None
        if token in self._stop_ids:
            reason = "stop"
        else:
            handle.token_ids.append(token)
            if len(handle.token_ids) >= handle.max_tokens:
                reason = "length"
        handle._pending = (token,)
        if reason is not None:
            handle.finish_reason = reason
            del self._active[handle.id]
            self._release(handle)
        return StepOutput(handle, token, reason is not None, reason)

    def _release(self, handle: SequenceHandle) -> None:
        self._free.append(handle.slot)
        if self.kv is not None and handle._grant is not None:
            self.kv.release(handle._grant)
            handle._grant = None

    def _validate(self, req: GenerationRequest) -> None:
        """Refuse what could never run: errors name the field, the value and the limit."""
        if isinstance(req.max_tokens, bool) or not isinstance(req.max_tokens, int) or req.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {req.max_tokens!r}")
        if (
            not isinstance(req.temperature, int | float)
            or not math.isfinite(req.temperature)
            or req.temperature < 0
        ):
            raise ValueError(f"temperature must be a finite number >= 0, got {req.temperature!r}")
        if req.seed is not None and (isinstance(req.seed, bool) or not isinstance(req.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {req.seed!r}")
        vocab = self.tokenizer.vocab_size
        for name, ids in (("prefix_ids", req.prefix_ids), ("prompt_ids", req.prompt_ids)):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{name} must be in 0..{vocab - 1}, got {bad[0]!r}")
        # BOS + prefix + prompt + every generated token but the last must fit in the context.
        needed = len(req.prefix_ids) + len(req.prompt_ids) + req.max_tokens
        if needed > self.max_context:
            prefix = f"prefix ({len(req.prefix_ids)} tokens) + " if req.prefix_ids else ""
            raise ValueError(
                f"{prefix}prompt ({len(req.prompt_ids)} tokens) + max_tokens ({req.max_tokens}) = {needed} "
                f"exceeds max_context {self.max_context}"
            )


def _choose(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """Greedy: the first maximal logit. Sampled: invert the CDF at one uniform draw."""
    if temperature == 0 or generator is None:
        return int(torch.argmax(logits))
    # Shift first: the largest logit becomes 0, so even a tiny temperature cannot overflow.
    probs = torch.softmax((logits - logits.max()) / temperature, dim=-1)
    cdf = torch.cumsum(probs, dim=-1)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    return int(torch.searchsorted(cdf, u.reshape(1), right=True).clamp_(max=len(cdf) - 1))
