"""The shared device context: one device, its streams and a memory budget per owner.

In the spine every collapsed middleware allocates its state here, next to the model, so
that a batch of requests is decided with tensor ops on one device. In the layered layout
each process makes its own context, so the same service classes serve both layouts.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from monolith import cupy_kernels
from monolith.device_config import DeviceConfig

log = logging.getLogger("spine.device")

# `memory_budget_mib: auto` on the CPU: the middlewares' tables and the tiny model's KV pool
# fit with room to spare, and a test run on a shared box stays small.
CPU_AUTO_BUDGET_BYTES = 256 * 1024 * 1024


def pick_device(preferred: str = "auto") -> torch.device:
    """CUDA when torch sees one (or when asked for), else the CPU."""
    if preferred == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(preferred)


def budget_bytes(device: torch.device, config: DeviceConfig) -> int:
    """The budget `config` asks for on `device`; `auto` reads the free memory now (CUDA)."""
    if config.memory_budget_mib != "auto":
        return int(config.memory_budget_mib) << 20
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * config.auto_memory_fraction)
    return CPU_AUTO_BUDGET_BYTES


@dataclass
class DeviceContext:
    """Owns the device and accounts every byte allocated through it to an owner."""

    device: torch.device = field(default_factory=pick_device)
    budget_bytes: int = CPU_AUTO_BUDGET_BYTES  # `for_section` sizes it from the `device` section

    @classmethod
    def for_section(cls, settings: DeviceConfig) -> DeviceContext:
        """A context on the picked device with the budget of the `device` section."""
        device = pick_device()
        context = cls(device=device, budget_bytes=budget_bytes(device, settings))
        log.info("device %s: memory budget %.1f MiB (device.memory_budget_mib: %s)",
                 device, context.budget_bytes / (1 << 20), settings.memory_budget_mib)
        return context
    _used: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _streams: dict[int, object] = field(default_factory=dict)

    def allocate(
        self, owner: str, shape: tuple[int, ...], dtype: torch.dtype, fill: float = 0.0
    ) -> torch.Tensor:
        nbytes = _nbytes(shape, dtype)
        with self._lock:
            total = sum(self._used.values())
            if total + nbytes > self.budget_bytes:
                raise MemoryError(
                    f"device budget exceeded: {owner} asked for {nbytes} bytes, "
                    f"{total} of {self.budget_bytes} already used "
                    f"({', '.join(f'{k}={v}' for k, v in sorted(self._used.items()))})"
                )
            self._used[owner] += nbytes
        return torch.full(shape, fill, dtype=dtype, device=self.device)

    def release(self, owner: str, tensor: torch.Tensor) -> None:
        with self._lock:
            self._used[owner] = max(0, self._used[owner] - tensor.numel() * tensor.element_size())

    def scatter_add(self, table: torch.Tensor, rows: torch.Tensor, amounts: torch.Tensor) -> torch.Tensor:
        """Counter updates for the services' tables: CuPy's atomicAdd kernel on CUDA when the
        `gpu` extra is installed (imported lazily, on first use), torch's index_add_ otherwise."""
        return cupy_kernels.scatter_add(table, rows, amounts, checked=False)

    def usage(self) -> dict[str, int]:
        """Bytes in use per owner, for `spine status` and the benchmark."""
        with self._lock:
            return dict(self._used)

    def stream(self, priority: int = 0) -> object | None:
        """A CUDA stream for a priority class (higher runs first); None on the CPU."""
        if self.device.type != "cuda":
            return None
        with self._lock:
            if priority not in self._streams:
                # CUDA stream priorities: lower numbers run first; torch exposes -1..0 on most GPUs.
                self._streams[priority] = torch.cuda.Stream(device=self.device, priority=-1 if priority > 0 else 0)
            return self._streams[priority]


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count * torch.empty((), dtype=dtype).element_size()
