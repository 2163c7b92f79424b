"""How many KV-cache slots fit: the bounded pool's size, from free device memory.

The formula (logged at start, and what `kv_cache_max_entries: auto` uses):

    per_slot_bytes = 2 (keys and values) × layers × heads × head_dim × max_len × dtype size
    usable_bytes   = free_bytes × memory_fraction − weight_bytes
    slots          = min(max_batch, floor(usable_bytes / per_slot_bytes))

`free_bytes` is the device's free memory — `torch.cuda.mem_get_info` on CUDA; on the CPU
`psutil`'s available memory, counted at most `cpu_cap_bytes` so that a big host does not
hand one process all of its RAM — and, when the device state keeps a budget of its own
(the spine's `DeviceContext`), no more than what is left of that budget. The weights are
subtracted even when already resident: a deliberate extra margin, on top of
`memory_fraction` (activations, allocator fragmentation, the other middlewares' tensors).

When every slot is busy, new requests wait in the scheduler's bounded queue and past it
are refused with RESOURCE_EXHAUSTED: the pool never grows, so the process cannot run out
of memory by taking one request too many.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from services.inference.model.interface import torch_device


@dataclass(frozen=True)
class KVPlan:
    """The pool's size and every figure it came from (for the start-up log and the bench)."""

    slots: int
    per_slot_bytes: int | None
    weight_bytes: int
    free_bytes: int
    memory_fraction: float
    memory_bound: int | None  # slots the memory allows (None: the model does not say its KV size)
    source: str  # "auto" or "config"

    @property
    def spare_bytes(self) -> int:
        """What the KV budget leaves after the pool (free × fraction − weights − slots × per
        slot): the room a slot pool's stored prefixes may take (`kv_prefix`)."""
        if self.per_slot_bytes is None:
            return 0
        usable = self.free_bytes * self.memory_fraction - self.weight_bytes
        return max(0, math.floor(usable - self.slots * self.per_slot_bytes))

    def describe(self) -> str:
        if self.per_slot_bytes is None:
            return (f"KV cache: {self.slots} slots ({self.source}); the model does not report its "
                    f"per-slot size, so the pool is bounded by max_batch only")
        pool = self.slots * self.per_slot_bytes
        return (f"KV cache: {self.slots} slots ({self.source}) × {_mib(self.per_slot_bytes)} per slot = "
                f"{_mib(pool)}; memory bound {self.memory_bound} slots = floor(({_mib(self.free_bytes)} free × "
                f"{self.memory_fraction} − {_mib(self.weight_bytes)} weights) / {_mib(self.per_slot_bytes)})")


def kv_bytes_per_slot(model: Any, max_context: int) -> int | None:
    """2 × layers × heads × head_dim × max_len × dtype size, when the model says its shape."""
    report = getattr(model, "kv_bytes_per_slot", None)
    return int(report(max_context)) if callable(report) else None


def kv_slot_limit(model: Any, max_context: int) -> int | None:
    """Slots a model that keeps its KV budget in its own terms allows (the `sim` model's
    tokens: it holds no memory of this process's); None when it says nothing."""
    report = getattr(model, "kv_slot_limit", None)
    return int(report(max_context)) if callable(report) else None


def weight_bytes(model: Any) -> int:
    """Bytes of a torch module's parameters and buffers (0 for anything else)."""
    module = model if isinstance(model, torch.nn.Module) else getattr(model, "module", None)
    if not isinstance(module, torch.nn.Module):
        return 0
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def free_device_bytes(device: Any, cpu_cap_bytes: int | None = None) -> int:
    """Free memory where `device` lives (capped on the CPU), within a DeviceState's own budget."""
    dev = torch_device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
    else:
        import psutil

        free = int(psutil.virtual_memory().available)
        if cpu_cap_bytes is not None:
            free = min(free, cpu_cap_bytes)
    budget = getattr(device, "budget_bytes", None)
    usage = getattr(device, "usage", None)
    if isinstance(budget, int) and callable(usage):
        free = min(free, max(0, budget - sum(usage().values())))
    return int(free)


def plan_kv_slots(
    *,
    per_slot_bytes: int | None,
    weight_bytes: int,
    free_bytes: int,
    memory_fraction: float,
    max_batch: int,
    requested: int | None = None,
) -> KVPlan:
    """The pool size for `requested` slots (None = auto); ValueError names the bound it breaks."""
    bound = None
    if per_slot_bytes:
        bound = max(0, math.floor((free_bytes * memory_fraction - weight_bytes) / per_slot_bytes))
    figures = dict(per_slot_bytes=per_slot_bytes, weight_bytes=weight_bytes, free_bytes=free_bytes,
                   memory_fraction=memory_fraction, memory_bound=bound)
    if requested is None:
        slots = max_batch if bound is None else min(max_batch, bound)
        if slots < 1:
            raise ValueError(
                f"not enough memory for one KV cache slot: {_mib(free_bytes)} free × {memory_fraction} − "
                f"{_mib(weight_bytes)} weights < {_mib(per_slot_bytes or 0)} per slot")
        return KVPlan(slots=slots, source="auto", **figures)  # type: ignore[arg-type]
    if requested > max_batch:
        raise ValueError(f"{requested} slots is more than max_batch ({max_batch})")
    if bound is not None and requested > bound:
        raise ValueError(
            f"{requested} slots need {_mib(requested * (per_slot_bytes or 0))}, but memory allows {bound} "
            f"(floor(({_mib(free_bytes)} free × {memory_fraction} − {_mib(weight_bytes)} weights) / "
            f"{_mib(per_slot_bytes or 0)} per slot))")
    return KVPlan(slots=requested, source="config", **figures)  # type: ignore[arg-type]


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"
