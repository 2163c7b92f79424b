"""What every service shares: config errors and the device-state interface.

Services never import `monolith/` or `migration/`: they receive a `DeviceState` (the
spine's shared `monolith.device.DeviceContext`, or a per-process one in the layered
layout) and allocate their state through it. That is what lets one class serve both
layouts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from wire.v1 import batch_pb2

if TYPE_CHECKING:  # torch is heavy to import; processes that never touch tensors skip it
    import torch

Clock = Callable[[], float]


class ConfigError(ValueError):
    """A configuration value a person must fix; the message names the field and the value."""


class DeviceState(Protocol):
    """Where a service keeps its state: one device, a memory budget accounted per owner."""

    @property
    def device(self) -> torch.device: ...

    def allocate(
        self, owner: str, shape: tuple[int, ...], dtype: torch.dtype, fill: float = 0.0
    ) -> torch.Tensor:
        """A new tensor charged to `owner`; raises MemoryError past the budget."""
        ...

    def release(self, owner: str, tensor: torch.Tensor) -> None:
        """Return a tensor's bytes to the budget (e.g. when a table grows)."""
        ...

    def scatter_add(self, table: torch.Tensor, rows: torch.Tensor, amounts: torch.Tensor) -> torch.Tensor:
        """table.view(-1)[rows[i]] += amounts[i] for every i, repeats adding up; in place.

        The device's counter update: a raw atomicAdd kernel where the device has one
        (CuPy on CUDA), torch's index_add_ elsewhere. Rows must already be in range.
        """
        ...


class ReadHooks:
    """Callbacks a service runs before it reads its own state.

    Whoever holds writes not yet handed in (the spine's completions window) registers one,
    so a reader (a scrape, a log flush, a cache lookup) never misses a write that was
    already accepted. The arguments are the service's to define (the cache passes the keys
    it is about to probe).
    """

    def __init__(self) -> None:
        self._hooks: list[Callable[..., None]] = []

    def add(self, hook: Callable[..., None]) -> None:
        self._hooks.append(hook)

    def remove(self, hook: Callable[..., None]) -> None:
        if hook in self._hooks:
            self._hooks.remove(hook)

    def run(self, *args: Any) -> None:
        for hook in list(self._hooks):
            hook(*args)


# -- batch rpcs ---------------------------------------------------------------------------
# Every middleware's operations are batch rpcs, each item answered with its own status: these
# keep that status the same in every service.

_STATUS_BY_NUMBER: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


def status_code(number: int) -> grpc.StatusCode:
    """The grpc.StatusCode for a status number (UNKNOWN for a number gRPC does not define)."""
    return _STATUS_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


def set_status(status: batch_pb2.ItemStatus, code: grpc.StatusCode, message: str) -> None:
    """Mark one item of a batch answer as failed with the status a call for it alone would end with."""
    status.code = code.value[0]
    status.message = message
