"""A zero-copy numpy view of a CPU tensor, made once per tensor.

Why: the spine's tables (token buckets, counters, histograms) are updated on the host
through numpy views of their CPU tensors, per request. Asking a tensor for its `.device`
and making a `.numpy()` view each time cost more than the update itself on a request path
whose caches the model's step has just evicted (`python -m bench.cold_path` shows such
costs). A table replaces its tensor only when it grows, so the view is
made again only then.

`cells(tensor)` is the same memory as a `memoryview`, for the paths that read and write a
few single cells per request: a memoryview's element access is plain CPython (a Python
float or int in and out), where a numpy element access goes through numpy's scalar
machinery — twice the time warm, and on a request path the model's step has left cold,
a second large body of code to fetch from memory.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class HostView:
    """`of(tensor)`: the numpy view of `tensor` if it lives on the CPU, else None; cached
    until a different tensor is asked for (the old one is let go then)."""

    __slots__ = ("_tensor", "_view", "_cells")

    def __init__(self) -> None:
        self._tensor: Any = None
        self._view: np.ndarray | None = None
        self._cells: Any = None  # a memoryview (typeshed's knows only int cells)

    def of(self, tensor: Any) -> np.ndarray | None:
        if tensor is not self._tensor:
            self._view = tensor.numpy() if tensor.device.type == "cpu" else None
            self._cells = None
            self._tensor = tensor
        return self._view

    def cells(self, tensor: Any) -> Any:
        """`of(tensor)` as a memoryview indexed like it (`cells[row, column]`), or None off the CPU."""
        view = self.of(tensor)
        if view is None:
            return None
        if self._cells is None:
            self._cells = memoryview(view)  # type: ignore[arg-type]
        return self._cells
