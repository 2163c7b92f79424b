"""Optional CUDA kernels through CuPy, sharing memory with torch via DLPack.

CuPy is the `gpu` extra: it is imported lazily, on first use and only when torch sees
CUDA, never at module import — nothing in the default install needs it. Every kernel has
a torch fallback with the same result, which is what runs on the CPU (and in CI).

`scatter_add` is the counters' update (one atomicAdd per row, any number of repeats of
a row in one batch). The metric tables reach it through `DeviceContext.scatter_add` (the
services never import this package; the device state they are given carries the kernel).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

_SCATTER_ADD = r"""
extern "C" __global__ void scatter_add_i64(long long* table, const long long* rows,
                                           const long long* amounts, const long long n) {
    long long i = (long long)blockDim.x * blockIdx.x + threadIdx.x;
    if (i < n) {
        atomicAdd((unsigned long long*)&table[rows[i]], (unsigned long long)amounts[i]);
    }
}
"""


@functools.cache
def _cupy() -> Any | None:
    """The cupy module when it can run here, else None (no CUDA, or the extra not installed)."""
    if not torch.cuda.is_available():
        return None
    try:
        import cupy  # lazy on purpose: the gpu extra is optional
    except ImportError:
        return None
    return cupy


def available() -> bool:
    """Whether the CuPy path is used on this machine."""
    return _cupy() is not None


@functools.cache
def _kernel() -> Any:
    cupy = _cupy()
    assert cupy is not None
    return cupy.RawKernel(_SCATTER_ADD, "scatter_add_i64")


def scatter_add(table: torch.Tensor, rows: torch.Tensor, amounts: torch.Tensor, *,
                checked: bool = True) -> torch.Tensor:
    """table[rows[i]] += amounts[i] for every i (repeats add up), in place; returns `table`.

    On a CUDA int64 table with CuPy present: one atomicAdd per element, on torch's current
    stream, on the very memory torch owns (DLPack, no copy). Otherwise torch's index_add_.
    `checked=False` skips the range check (two device-to-host reads on CUDA) for callers
    whose rows come from their own index, like the metric tables.
    """
    if rows.numel() != amounts.numel():
        raise ValueError(f"rows and amounts: expected the same length, got {rows.numel()} and {amounts.numel()}")
    if checked and rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= table.numel()):
        raise IndexError(f"rows: every row must be in [0, {table.numel()}), got {int(rows.min())}..{int(rows.max())}")
    if table.is_cuda and table.dtype == torch.int64 and table.is_contiguous() and available():
        return _scatter_add_cupy(table, rows, amounts)
    table.view(-1).index_add_(0, rows.to(table.device, torch.int64), amounts.to(table.device, table.dtype))
    return table


def _scatter_add_cupy(table: torch.Tensor, rows: torch.Tensor, amounts: torch.Tensor) -> torch.Tensor:
    cupy = _cupy()
    assert cupy is not None
    n = rows.numel()
    if n == 0:
        return table
    rows = rows.to(table.device, torch.int64).contiguous()
    amounts = amounts.to(table.device, torch.int64).contiguous()
    stream = torch.cuda.current_stream(table.device)
    with cupy.cuda.ExternalStream(stream.cuda_stream):
        target = cupy.from_dlpack(table.view(-1))
        threads = 256
        _kernel()(((n + threads - 1) // threads,), (threads,),
                  (target, cupy.from_dlpack(rows), cupy.from_dlpack(amounts), cupy.int64(n)))
    return table
