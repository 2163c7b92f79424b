"""A device context made on first use, so that a process whose components keep no tensors
never imports torch.

Why: in the layered layout every middleware is its own process, and each made its
`DeviceContext` at start. Auth and the router keep no tensor state, and the layered
gateway (placing everything remote) none at all, yet importing torch was ~1.5 s of a
child's ~2.3 s start on a 2-core host and ~250 MB of its memory: a layered stack of eight
processes took ~9.5 s to come up. Made on first use, the context (and torch) arrive with
the first component that allocates a tensor, and only there.

The methods are `monolith.device.DeviceContext`'s, forwarded; `made` says whether the
context exists yet (the tests use it to show who never needed one).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from monolith.device_config import DeviceConfig

if TYPE_CHECKING:  # torch stays out of processes that never allocate a tensor
    import torch

    from monolith.device import DeviceContext


class DeviceOnFirstUse:
    """`DeviceContext.for_section(settings)`, made the first time anything asks it for something."""

    def __init__(self, settings: DeviceConfig) -> None:
        self._settings = settings
        self._context: DeviceContext | None = None
        self._lock = threading.Lock()

    @property
    def made(self) -> bool:
        return self._context is not None

    @property
    def context(self) -> DeviceContext:
        """The real context, made now if it was not yet (thread-safe: made once)."""
        context = self._context
        if context is None:
            with self._lock:
                if self._context is None:
                    from monolith.device import DeviceContext
                    from monolith.runtime_env import apply_torch_threads

                    apply_torch_threads()  # torch arrives now, in a process that set its threads
                    self._context = DeviceContext.for_section(self._settings)
                context = self._context
        return context

    def make_now(self) -> None:
        """Make the context now (a process whose component works with tensors does it at
        start, so that no request pays for it: on CUDA it initialises the device)."""
        _ = self.context

    # -- DeviceState, and the rest of DeviceContext, forwarded ---------------------------------
    @property
    def device(self) -> torch.device:
        return self.context.device

    @property
    def budget_bytes(self) -> int:
        return self.context.budget_bytes

    def allocate(self, owner: str, shape: tuple[int, ...], dtype: torch.dtype, fill: float = 0.0) -> torch.Tensor:
        return self.context.allocate(owner, shape, dtype, fill)

    def release(self, owner: str, tensor: torch.Tensor) -> None:
        self.context.release(owner, tensor)

    def scatter_add(self, table: torch.Tensor, rows: torch.Tensor, amounts: torch.Tensor) -> torch.Tensor:
        return self.context.scatter_add(table, rows, amounts)

    def usage(self) -> dict[str, int]:
        """Bytes in use per owner; nothing when no tensor was ever allocated (torch stays out)."""
        return self.context.usage() if self._context is not None else {}

    def stream(self, priority: int = 0) -> object | None:
        return self.context.stream(priority)
