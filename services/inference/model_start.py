"""What a model's service decides once, as it starts: the KV pool's size, the first cost per
token, and (where asked) deterministic kernels; and the one forward its health check runs.

Each is measured or derived before the first request: the KV slots from the device's free
memory and the model's size (`kv_budget`), the ms per token from a tiny warm-up on the real
engine (the compute budgets' first figure, replaced by the measured steps as requests run),
and deterministic mode's process-wide switches, undone when the service closes.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

import torch

from services.common import ConfigError, DeviceState
from services.inference.config import InferenceConfig
from services.inference.model.backend import ModelBackend
from services.inference.model.engine import GenerationRequest
from services.inference.model.interface import Segment
from services.inference.model.kv_budget import (
    KVPlan,
    free_device_bytes,
    kv_bytes_per_slot,
    kv_slot_limit,
    plan_kv_slots,
    weight_bytes,
)


def plan_kv(config: InferenceConfig, backend: ModelBackend, device: DeviceState) -> KVPlan:
    """The KV pool for `backend` on `device`, within the config's limits."""
    model = backend.model
    limit = kv_slot_limit(model, backend.max_context)
    try:
        return plan_kv_slots(
            per_slot_bytes=kv_bytes_per_slot(model, backend.max_context),
            weight_bytes=weight_bytes(model),
            free_bytes=free_device_bytes(device, int(config.kv_cpu_memory_cap_mb * (1 << 20))),
            memory_fraction=config.kv_memory_fraction,
            max_batch=config.max_batch if limit is None else min(config.max_batch, limit),
            requested=config.kv_slots)
    except ValueError as error:
        raise ConfigError(f"inference.kv_cache_max_entries: {error}") from error


def warm_up_ms_per_token(backend: ModelBackend, engine: Any, warmup_tokens: int) -> float:
    """Decode cost from a tiny warm-up (one run to warm the kernels, one measured): the
    start of the measured cost, for the first requests."""
    prompt = backend.encode("warm up")[: max(1, engine.max_context // 4)]
    tokens = max(1, min(warmup_tokens, engine.max_context - len(prompt) - 1))
    request = GenerationRequest(prompt_ids=prompt, max_tokens=tokens)
    engine.generate([request])
    started = time.perf_counter()
    result = engine.generate([request])[0]
    elapsed_ms = (time.perf_counter() - started) * 1000.0
    steps = len(result.token_ids) + (1 if result.finish_reason == "stop" else 0)
    return elapsed_ms / max(1, steps)


def enter_deterministic(seed: int) -> bool:
    """Deterministic kernels and fixed seeds for this process; what to restore (`leave_deterministic`)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it for determinism
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.manual_seed(seed)
    random.seed(seed)
    return before


def leave_deterministic(before: bool) -> None:
    torch.use_deterministic_algorithms(before)


def probe_forward(backend: ModelBackend, device: torch.device) -> None:
    """One tiny forward (BOS alone) on `device`; raises when the model cannot run (the deep
    health check's probe).

    It uses a one-slot cache of its own, so it never touches a running sequence's slot and
    needs no engine lock; the `.to("cpu")` waits for the device to finish.
    """
    model = backend.model
    cache = model.new_cache(1, 2, device)
    try:
        logits = model.step([Segment(0, 0, (backend.tokenizer.bos_id,))], cache).to("cpu")
    finally:
        model.release_cache(cache, device)
    if logits.shape[0] != 1 or not bool(torch.isfinite(logits).any()):
        raise RuntimeError(f"health forward gave unusable logits (shape {tuple(logits.shape)})")
