"""What every service shares: config errors and the device-state interface.

Services never import `monolith/` or `migration/`: they receive a `DeviceState` (the
spine's shared `monolith.device.DeviceContext`, or a per-process one in the layered
layout) and allocate their state through it. That is what lets one class serve both
layouts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
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


def section(config: Mapping[str, Any] | None, name: str) -> Mapping[str, Any]:
    """The `name` section of a config mapping, or {}; a non-mapping is a ConfigError."""
    if config is None:
        return {}
    value = config.get(name, {})
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{name}: expected a mapping, got {type(value).__name__}")
    return value


def number(cfg: Mapping[str, Any], key: str, default: float, *, where: str, minimum: float = 0.0,
           maximum: float | None = None) -> float:
    """A number field with a lower (and optionally an upper) bound, or a ConfigError naming `where.key`."""
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}.{key}: expected a number, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{where}.{key}: must be >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{where}.{key}: must be <= {maximum}, got {value!r}")
    return float(value)


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
# Every middleware declares a batch rpc; its per-request rpc is the batch of one. These
# helpers keep the per-item status and the single-call abort the same in every service.

_STATUS_BY_NUMBER: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


def status_code(number: int) -> grpc.StatusCode:
    """The grpc.StatusCode for a status number (UNKNOWN for a number gRPC does not define)."""
    return _STATUS_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


def set_status(status: batch_pb2.ItemStatus, code: grpc.StatusCode, message: str) -> None:
    """Mark one item of a batch answer as failed with the status its per-request rpc would end with."""
    status.code = code.value[0]
    status.message = message


def answer_one(result: Any, context: Any) -> Any:
    """The per-request rpc's answer from a batch-of-one result: its response, or abort with its status."""
    if result.status.code:
        context.abort(status_code(result.status.code), result.status.message)
    return result.response


def abort_on_item(status: batch_pb2.ItemStatus, context: Any) -> None:
    """For batch-of-one rpcs whose results are bare statuses (metrics, logs)."""
    if status.code:
        context.abort(status_code(status.code), status.message)
