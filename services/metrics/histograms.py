"""Metric series as rows of device tensors, updated one micro-batch at a time.

Why tensors: in the spine the metric state sits on the same device as the model, and a
micro-batch of N requests becomes one `bucketize` + one `index_add_` instead of N dictionary
updates. A host-side dict maps each series key (a tuple of strings) to its row; the tensors
grow by doubling, so a new series costs amortized O(1) and memory is charged to the device
budget through `DeviceState.allocate`.

The tables are not thread-safe: the owner (e.g. `MetricsService`) serializes updates and
snapshots with its own lock, so that related tables change together.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.common import DeviceState
from services.common.host_view import HostView

SeriesKey = tuple[str, ...]


@dataclass(frozen=True)
class HistogramSeries:
    """One series, ready to print: cumulative counts per `le` bound (+Inf last), sum, count."""

    key: SeriesKey
    cumulative: tuple[int, ...]
    sum: float

    @property
    def count(self) -> int:
        return self.cumulative[-1] if self.cumulative else 0


class _Rows:
    """Series key -> row index, plus the tensors' capacity in rows."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"initial_rows: must be >= 1, got {capacity}")
        self.capacity = capacity
        self.index: dict[SeriesKey, int] = {}

    def rows_for(self, keys: Sequence[SeriesKey]) -> tuple[list[int], list[SeriesKey], int]:
        """Rows for `keys` (new keys get new rows), the new keys, and the capacity needed."""
        rows = []
        added: list[SeriesKey] = []
        for key in keys:
            row = self.index.get(key)
            if row is None:
                row = len(self.index)
                self.index[key] = row
                added.append(key)
            rows.append(row)
        needed = self.capacity
        while needed < len(self.index):
            needed *= 2
        return rows, added, needed

    def forget(self, added: Sequence[SeriesKey]) -> None:
        """Undo `rows_for`'s new keys when the table could not grow to hold them."""
        for key in added:
            del self.index[key]


def _grown(device: DeviceState, owner: str, old: torch.Tensor, rows: int) -> torch.Tensor:
    """A copy of `old` with `rows` rows (zero-filled past the old ones); `old` is released."""
    new = device.allocate(owner, (rows, *old.shape[1:]), old.dtype)
    new[: old.shape[0]].copy_(old)
    device.release(owner, old)
    return new


class HistogramTable:
    """Prometheus-style histograms: counts [series, buckets] int64 and sums [series] float64.

    Bucket i counts observations with bounds[i-1] < v <= bounds[i] (the `le` rule); the last
    column is +Inf. Counts are stored per bucket and made cumulative only when read.
    """

    def __init__(
        self, device: DeviceState, bounds: Sequence[float], *, owner: str = "metrics", initial_rows: int = 64
    ) -> None:
        values = [float(b) for b in bounds]
        if not values or any(not math.isfinite(b) for b in values):
            raise ValueError(f"bounds: need at least one finite bound, got {list(bounds)!r}")
        if any(b <= a for a, b in zip(values, values[1:], strict=False)):
            raise ValueError(f"bounds: must be strictly increasing, got {values!r}")
        self._device = device
        self._owner = owner
        self._rows = _Rows(initial_rows)
        self.bounds: tuple[float, ...] = tuple(values)
        self._bounds_t = torch.tensor(values, dtype=torch.float64, device=device.device)
        self._counts = device.allocate(owner, (initial_rows, len(values) + 1), torch.int64)
        self._sums = device.allocate(owner, (initial_rows,), torch.float64)
        self._counts_host, self._sums_host = HostView(), HostView()  # their host views on the CPU
        self.host_paths = True  # False forces the torch ops CUDA uses (tests compare the paths)

    def __len__(self) -> int:
        return len(self._rows.index)

    def observe(self, keys: Sequence[SeriesKey], values: Sequence[float]) -> None:
        """Add one observation per (key, value) pair, all in one vectorized update."""
        if len(keys) != len(values):
            raise ValueError(f"observe: {len(keys)} keys but {len(values)} values")
        if not keys:
            return
        rows, added, needed = self._rows.rows_for(keys)
        try:
            self._ensure(needed)
        except MemoryError:
            self._rows.forget(added)
            raise
        counts = self._counts_host.cells(self._counts) if self.host_paths else None
        if counts is not None:
            # Zero-copy memoryviews of the same tensors: for the few observations a
            # micro-batch brings, per-element updates beat a torch op's dispatch cost ~10x.
            # `bisect_left` is bucketize's `le` rule; sums are added in the same order.
            sums, bounds = self._sums_host.cells(self._sums), self.bounds
            assert sums is not None  # on the same device as the counts
            for row, value in zip(rows, values, strict=True):
                # NaN (never from the metrics service, which refuses it) goes where bucketize puts it.
                counts[row, bisect_left(bounds, value) if value == value else len(bounds)] += 1
                sums[row] += value
            return
        dev = self._device.device
        row_t = torch.tensor(rows, dtype=torch.int64, device=dev)
        val_t = torch.tensor(values, dtype=torch.float64, device=dev)
        buckets = torch.bucketize(val_t, self._bounds_t, right=False)
        width = self._counts.shape[1]
        self._device.scatter_add(self._counts, row_t * width + buckets, torch.ones_like(row_t))
        self._sums.index_add_(0, row_t, val_t)

    def snapshot(self) -> list[HistogramSeries]:
        """Every series, sorted by key: one device-to-host copy per tensor."""
        n = len(self._rows.index)
        cumulative = self._counts[:n].cumsum(dim=1).cpu().tolist()
        sums = self._sums[:n].cpu().tolist()
        return [
            HistogramSeries(key, tuple(int(c) for c in cumulative[row]), float(sums[row]))
            for key, row in sorted(self._rows.index.items())
        ]

    def _ensure(self, rows: int) -> None:
        if rows > self._counts.shape[0]:
            # Allocate both before swapping either, so a MemoryError leaves the table intact.
            counts = self._device.allocate(self._owner, (rows, self._counts.shape[1]), torch.int64)
            try:
                sums = self._device.allocate(self._owner, (rows,), torch.float64)
            except MemoryError:
                self._device.release(self._owner, counts)
                raise
            counts[: self._counts.shape[0]].copy_(self._counts)
            sums[: self._sums.shape[0]].copy_(self._sums)
            self._device.release(self._owner, self._counts)
            self._device.release(self._owner, self._sums)
            self._counts, self._sums = counts, sums
            self._rows.capacity = rows


class CounterTable:
    """Monotonic int64 counters, one row per series, added to a batch at a time."""

    def __init__(self, device: DeviceState, *, owner: str = "metrics", initial_rows: int = 64) -> None:
        self._device = device
        self._owner = owner
        self._rows = _Rows(initial_rows)
        self._values = device.allocate(owner, (initial_rows,), torch.int64)
        self._values_host = HostView()  # its numpy view on the CPU
        self.host_paths = True  # False forces the torch ops CUDA uses (tests compare the paths)

    def __len__(self) -> int:
        return len(self._rows.index)

    def add(self, keys: Sequence[SeriesKey], amounts: Sequence[int]) -> None:
        """Add amounts[i] to series keys[i]; a key may repeat within one call."""
        if len(keys) != len(amounts):
            raise ValueError(f"add: {len(keys)} keys but {len(amounts)} amounts")
        if any(a < 0 for a in amounts):
            raise ValueError(f"add: counters only go up, got amounts {list(amounts)!r}")
        if not keys:
            return
        rows, added, needed = self._rows.rows_for(keys)
        if needed > self._values.shape[0]:
            try:
                self._values = _grown(self._device, self._owner, self._values, needed)
            except MemoryError:
                self._rows.forget(added)
                raise
            self._rows.capacity = needed
        values = self._values_host.cells(self._values) if self.host_paths else None
        if values is not None:  # a zero-copy view (see HistogramTable.observe)
            for row, amount in zip(rows, amounts, strict=True):
                values[row] += amount
            return
        dev = self._device.device
        self._device.scatter_add(
            self._values,
            torch.tensor(rows, dtype=torch.int64, device=dev),
            torch.tensor(amounts, dtype=torch.int64, device=dev),
        )

    def snapshot(self) -> list[tuple[SeriesKey, int]]:
        """Every (key, value), sorted by key."""
        values = self._values[: len(self._rows.index)].cpu().tolist()
        return [(key, int(values[row])) for key, row in sorted(self._rows.index.items())]
