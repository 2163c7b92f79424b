"""`sim`: a model with no weights whose steps take a device's time, off the CPU.

Why it exists: the embedded model runs on the host CPU, on the core the spine's middleware
runs on, so every microsecond of middleware is one the model loses. A real deployment's
model runs on a GPU: while a step runs, the host thread that launched it waits on the
CUDA stream and the CPU is free. `sim` is that second case, without a GPU (as llm-d's
inference simulator is for gateway benchmarks): each `step` blocks its caller for the time
a cost model gives, in `time.sleep` (which releases the GIL and uses no CPU, as a thread
waiting on a stream does), and returns logits chosen from a hash of the sequence so far.

The cost of one step, for the segments the engine hands over (continuous batching: new
sequences bring their prompts, running ones one token):

    device_ms = decode_base_ms + decode_ms_per_seq × len(segments)
                + prefill_ms_per_token × (tokens of the segments longer than one token)

The host's own work of the step (hashing the new tokens) overlaps the device time, as
kernel launches overlap a stream: the step ends at start + device_ms, or later when the
host work took longer.

Tokens are deterministic and batch-invariant: position p of a sequence holds a 64-bit
rolling hash of its tokens 0..p, stored in the cache's blocks as a KV cache stores keys
(`SimCache` is a `PagedCache`, so the engine's KV pool, prefix sharing included, works on
it unchanged), and the next token is a function of the hash at the last position alone.
So an answer is the same alone or in any batch, in any layout, with or without a shared
prefix. Greedy answers are printable ASCII and never stop early (finish reason `length`),
which keeps a benchmark's work per request fixed.

The KV budget is counted in tokens (`kv_budget_tokens`), not in host memory: the pool
holds at most `kv_budget_tokens // max_context` slots (`kv_slot_limit`, read by the
inference service's KV plan), and `/metrics` reports its blocks in the bytes the profiled
model would use (`kv_bytes_per_token`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from services.common import ConfigError
from services.inference.config import SIM_CLASS
from services.inference.model.interface import DeviceLike, Segment, TokenizedBackend
from services.inference.model.tokenizer import ByteTokenizer

BLOCK_TOKENS = 16  # positions per block, as the embedded model's KV pool
_MASK = (1 << 64) - 1
_PRINTABLE = tuple(range(32, 127))  # greedy answers are printable ASCII bytes
_TOP_LOGIT = 8.0  # the chosen token's logit (the others 0): a sampled answer mostly follows it


@dataclass(frozen=True)
class SimProfile:
    """The cost model of one model on one device (milliseconds of device time, tokens)."""

    name: str
    prefill_ms_per_token: float
    decode_base_ms: float
    decode_ms_per_seq: float
    kv_budget_tokens: int
    kv_bytes_per_token: int
    max_context: int

    def step_ms(self, sequences: int, prefill_tokens: int) -> float:
        """Device milliseconds of one step over `sequences` with `prefill_tokens` of prompts."""
        return (self.decode_base_ms + self.decode_ms_per_seq * sequences
                + self.prefill_ms_per_token * prefill_tokens)


# The default profile: Llama-3-8B-Instruct, bf16, served by vLLM on one H100 SXM 80 GB.
# Source, cited from memory (no copy of the pages was at hand when this was written, so the
# figures are rounded, and the GPU run of tests/gpu/run.sh is there to replace them):
# - decode: vLLM's v0.6.0 performance post (blog.vllm.ai, 2024-09-05, "vLLM v0.6.0: 2.7x
#   Throughput Improvement and 5x Latency Reduction") measures Llama 3 8B on 1×H100 at a TPOT
#   of a few ms at low load; the roofline agrees: a step reads the 16 GB of weights at
#   ~3.35 TB/s, 4.8 ms, plus launch and sampling overhead → 6.5 ms at batch 1. Each further
#   sequence adds its KV reads and its share of the GEMMs: ~0.06 ms at short context, so a
#   batch of 256 steps in ~22 ms (vLLM's published decode throughput for 8B on H100, a few
#   thousand tokens/s at batch 64-256, is of that order).
# - prefill: 2 × 8e9 FLOP per token at ~50% of the H100's 989 bf16 TFLOPS → 0.03 ms/token
#   (a 1,000-token prompt: ~30 ms to the first token, as vLLM's TTFT figures for short prompts).
# - KV: 32 layers × 8 KV heads × 128 dims × 2 (K, V) × 2 bytes = 128 KiB per token; vLLM at
#   gpu_memory_utilization 0.9 leaves ~54 GiB for it after 16 GB of weights → ~430k tokens.
LLAMA3_8B_H100 = SimProfile(name="llama-3-8b-bf16-h100-vllm", prefill_ms_per_token=0.03, decode_base_ms=6.5,
                            decode_ms_per_seq=0.06, kv_budget_tokens=430_000, kv_bytes_per_token=131_072,
                            max_context=8192)
PROFILES: dict[str, SimProfile] = {LLAMA3_8B_H100.name: LLAMA3_8B_H100, "default": LLAMA3_8B_H100}
_NUMBERS = tuple(f.name for f in fields(SimProfile) if f.name != "name")
OPTIONS = ("profile", *_NUMBERS)


def profile_from(options: Mapping[str, Any], where: str = "inference.backend") -> SimProfile:
    """The profile `options` name (`profile`, default Llama-3-8B on H100), with any figure
    overridden; ConfigError names the option."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"{where}.options: unknown option(s) {', '.join(unknown)}; known: {', '.join(OPTIONS)}")
    name = options.get("profile", "default")
    if name not in PROFILES:
        raise ConfigError(f"{where}.options.profile: unknown profile {name!r}; known: {', '.join(PROFILES)}")
    profile = PROFILES[name]
    changes: dict[str, Any] = {}
    for key in _NUMBERS:
        if key not in options:
            continue
        value = options[key]
        integer = key in ("kv_budget_tokens", "kv_bytes_per_token", "max_context")
        valid = (not isinstance(value, bool) and isinstance(value, int | float)
                 and (not integer or isinstance(value, int)) and value >= 0)
        if not valid or (integer and value < 2):
            kind = "an integer >= 2" if integer else "a number >= 0"
            raise ConfigError(f"{where}.options.{key}: expected {kind}, got {value!r}")
        changes[key] = value
    if changes:
        profile = replace(profile, name=f"{profile.name}+{','.join(f'{k}={v}' for k, v in sorted(changes.items()))}",
                          **changes)
    return profile


class SimCache:
    """Per-position rolling hashes in blocks, read through per-slot block tables (a `PagedCache`)."""

    def __init__(self, slots: int, max_context: int, bytes_per_token: int) -> None:
        self.block_size = max(1, min(BLOCK_TOKENS, max_context))
        per_slot = -(-max_context // self.block_size)
        self.tables = [list(range(slot * per_slot, (slot + 1) * per_slot)) for slot in range(slots)]
        self.num_blocks = slots * per_slot
        self.block_bytes = bytes_per_token * self.block_size
        self.hashes = [[0] * self.block_size for _ in range(self.num_blocks)]

    def set_table(self, slot: int, blocks: list[int]) -> None:
        self.tables[slot] = blocks

    def clear(self) -> None:
        """Drop every hash (the cache given back)."""
        self.hashes = []

    def get(self, slot: int, position: int) -> int:
        return self.hashes[self.tables[slot][position // self.block_size]][position % self.block_size]

    def put(self, slot: int, position: int, value: int) -> None:
        self.hashes[self.tables[slot][position // self.block_size]][position % self.block_size] = value


class SimModel:
    """A `StepModel` that waits a profile's device time per step (see the module's doc)."""

    def __init__(self, profile: SimProfile, vocab_size: int, *, sleep: Any = time.sleep) -> None:
        self.profile = profile
        self._vocab_size = vocab_size
        self._sleep = sleep
        self._lock = threading.Lock()  # one device: two callers' steps (a health probe) take turns
        self.steps = 0
        self.device_s = 0.0  # device time slept, all steps

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def max_context(self) -> int:
        return self.profile.max_context

    def kv_slot_limit(self, max_context: int) -> int:
        """Slots the KV budget holds at `max_context` tokens each (whole blocks)."""
        block = max(1, min(BLOCK_TOKENS, max_context))
        return max(1, self.profile.kv_budget_tokens // (-(-max_context // block) * block))

    def new_cache(self, slots: int, max_context: int, device: DeviceLike) -> SimCache:
        if max_context > self.max_context:
            raise ValueError(f"max_context {max_context} exceeds the model's {self.max_context}")
        return SimCache(slots, max_context, self.profile.kv_bytes_per_token)

    def release_cache(self, cache: SimCache, device: DeviceLike) -> None:
        cache.clear()

    def step(self, segments: Sequence[Segment], cache: SimCache) -> torch.Tensor:
        prefill = sum(len(seg.token_ids) for seg in segments if len(seg.token_ids) > 1)
        device_s = self.profile.step_ms(len(segments), prefill) / 1000.0
        with self._lock:
            deadline = time.perf_counter() + device_s  # the "kernels" run from here ...
            logits = torch.zeros((len(segments), self._vocab_size), dtype=torch.float32)
            for row, seg in enumerate(segments):
                state = cache.get(seg.slot, seg.start - 1) if seg.start else 0
                for offset, token in enumerate(seg.token_ids):
                    state = _mix(state, token)
                    cache.put(seg.slot, seg.start + offset, state)
                logits[row, next_token(state)] = _TOP_LOGIT
            left = deadline - time.perf_counter()  # ... while the host prepared the answer
            if left > 0:
                self._sleep(left)  # off the CPU, the GIL released: a thread waiting on its stream
            self.steps += 1
            self.device_s += device_s
        return logits


def next_token(state: int) -> int:
    """The greedy token after a sequence whose last position's hash is `state`."""
    return _PRINTABLE[_mix(state, 0x5EED) % len(_PRINTABLE)]


def _mix(state: int, token: int) -> int:
    """splitmix64 of the state and the token: the hash of a sequence one token longer."""
    z = (state ^ ((token + 1) * 0x9E3779B97F4A7C15)) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


class SimBackend(TokenizedBackend):
    """A ModelBackend: the simulated model (`SimModel`) with the embedded byte tokenizer."""


def load_sim_backend(options: Mapping[str, Any], *, model_id: str | None = None,
                     where: str = "inference.backend") -> SimBackend:
    """`inference.backend: {class: sim, options: {profile: ..., decode_base_ms: ..., ...}}`."""
    if not isinstance(options, Mapping):
        raise ConfigError(f"{where}.options: expected a mapping, got {type(options).__name__}")
    profile = profile_from(options, where)
    tokenizer = ByteTokenizer()
    return SimBackend(model_id or SIM_CLASS, SimModel(profile, tokenizer.vocab_size), tokenizer)
