"""Load hints: what every Inference answer says about the load, as `x-spine-load` trailing metadata.

A compact `key=value;...` string, so that clients (spine/load_hints.py) and proxies can back
off or fall back before the server has to refuse:

    queue=3;running=16;slots=16;kv_free=0;mem_free_mb=5120.0;ms_per_token=0.9;busy=0.97[;util=71]

* ``queue``        requests waiting for a KV slot: the whole backlog (the servers give every
                   request the queue can hold a handler thread, so none wait in front of it);
* ``running``      sequences in the running batch (batch occupancy = running / slots);
* ``slots``        KV cache slots in the pool (`kv_cache_max_entries`);
* ``kv_free``      slots free right now;
* ``mem_free_mb``  free memory of the device (host memory on the CPU);
* ``ms_per_token`` what a token costs now: the wall time of a decode step at the running
                   batch's size, measured on every step (`services.inference.cost`);
* ``busy``         the busy fraction of the model's decode loop (0..1): the share of the
                   last second its scheduler spent stepping, not waiting for work
                   (`BusyMeter`); each model has its own loop, KV pool and hint;
* ``util``         device utilisation in percent (CUDA with NVML only): the GPU's own busy
                   figure, device-wide.

Every Gateway answer carries the hint of the model it was routed to: the model's own when
it was called, else (a cache hit, a refusal before the model) the latest the gateway has
(`services.gateway.model_load`).

Memory and utilisation are read at most every `REFRESH_S`: an answer must not pay for a
/proc or NVML read. Clients import this module to parse the header, so it imports torch
only when a gauge is made.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

LOAD_HEADER = "x-spine-load"
# Beside it on a Gateway answer: the routed model's fallback (the router's `fallback:`), and
# on a fallback's answer the hints of the models it stands in for, `model:hint[,model:hint]`.
FALLBACK_HEADER = "x-spine-fallback"
PRIMARY_LOAD_HEADER = "x-spine-primary-load"
REFRESH_S = 0.5


@dataclass(frozen=True)
class LoadReport:
    queue: int
    running: int
    slots: int
    kv_free: int
    mem_free_mb: float
    ms_per_token: float
    util: float | None = None
    busy: float = 0.0

    def header(self) -> str:
        text = (f"queue={self.queue};running={self.running};slots={self.slots};kv_free={self.kv_free};"
                f"mem_free_mb={self.mem_free_mb:.1f};ms_per_token={self.ms_per_token:.3f};busy={self.busy:.3f}")
        return text if self.util is None else f"{text};util={self.util:.0f}"


def busy_figure(load: dict[str, float]) -> float | None:
    """How busy a parsed hint says the device is (0..1): the GPU's own utilisation where the
    hint has one, else the decode loop's busy fraction; None when the hint has neither."""
    if "util" in load:
        return max(0.0, min(1.0, load["util"] / 100.0))
    if "busy" in load:
        return max(0.0, min(1.0, load["busy"]))
    return None


class BusyMeter:
    """The busy fraction of a loop: the share of the last `window_s` it spent working.

    Work is summed into `buckets` slots of the window (a step counts in the slot where it
    ended), so a loop that steps back to back reads 1 after one window and an idle one 0
    after one window. `add` comes from the loop's own thread; `fraction` from any thread and
    changes nothing."""

    def __init__(self, window_s: float = 1.0, buckets: int = 10, clock: Callable[[], float] = time.monotonic) -> None:
        self._width = window_s / buckets
        self._sums = [0.0] * buckets
        self._clock = clock
        self._last = int(clock() / self._width)  # the slot written last

    def add(self, seconds: float) -> None:
        """A step that just ended took `seconds`."""
        slot = int(self._clock() / self._width)
        n = len(self._sums)
        for stale in range(max(self._last + 1, slot - n + 1), slot + 1):
            self._sums[stale % n] = 0.0
        self._last = max(self._last, slot)
        self._sums[slot % n] += max(0.0, seconds)

    def fraction(self) -> float:
        now = self._clock()
        slot, n = int(now / self._width), len(self._sums)
        worked = sum(self._sums[k % n] for k in range(max(slot - n + 1, 0), self._last + 1) if k <= slot)
        window = (n - 1) * self._width + (now - slot * self._width)
        return max(0.0, min(1.0, worked / window))


def parse_load(text: str | None) -> dict[str, float]:
    """`key=value;...` back into numbers; malformed pairs are skipped, not fatal."""
    values: dict[str, float] = {}
    for pair in (text or "").split(";"):
        key, sep, raw = pair.partition("=")
        if not sep:
            continue
        try:
            values[key.strip()] = float(raw)
        except ValueError:
            continue
    return values


class DeviceGauge:
    """Free memory and utilisation of one device, refreshed at most every REFRESH_S."""

    def __init__(self, device: Any) -> None:
        from services.inference.model.interface import torch_device

        self._device = torch_device(device)
        self._lock = threading.Lock()
        self._at = -1e9
        self._mem_free_mb = 0.0
        self._util: float | None = None

    def read(self) -> tuple[float, float | None]:
        now = time.monotonic()
        with self._lock:
            if now - self._at >= REFRESH_S:
                self._mem_free_mb, self._util = self._measure()
                self._at = now
            return self._mem_free_mb, self._util

    def _measure(self) -> tuple[float, float | None]:
        if self._device.type == "cuda":
            import torch

            free, _ = torch.cuda.mem_get_info(self._device)
            try:
                util: float | None = float(torch.cuda.utilization(self._device))
            except Exception:  # NVML missing: utilisation is optional
                util = None
            return free / (1 << 20), util
        import psutil

        return psutil.virtual_memory().available / (1 << 20), None
