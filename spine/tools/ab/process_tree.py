"""Measuring a layout's process tree: CPU seconds, peak resident memory, GPU memory.

A layout is a process tree (the spine alone, or a gateway and its children), so every
figure sums the whole tree; a process that exits while it is looked at is skipped.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections.abc import Mapping
from typing import Any

import psutil


class gone:
    """Ignore a process that exited while we looked at it."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, *rest: Any) -> bool:
        return kind is not None and issubclass(kind, psutil.Error)


def tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and all its descendants so far."""
    total = 0.0
    for process in tree(pid):
        with gone():
            times = process.cpu_times()
            total += times.user + times.system
    return total


def tree_rss_bytes(pid: int) -> int:
    total = 0
    for process in tree(pid):
        with gone():
            total += process.memory_info().rss
    return total


def device_bytes_by_pid() -> dict[int, int]:
    """GPU memory per process from nvidia-smi (empty without an NVIDIA driver)."""
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return {}
    try:
        out = subprocess.run([tool, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=5, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    usage: dict[int, int] = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            usage[int(parts[0])] = usage.get(int(parts[0]), 0) + int(parts[1]) * (1 << 20)
    return usage


class TreeMonitor:
    """Samples each tree's resident memory (and GPU memory, when there is a GPU) for peaks."""

    def __init__(self, pids: Mapping[str, int], interval_s: float = 0.1, device_interval_s: float = 1.0) -> None:
        self.pids = dict(pids)
        self.interval_s = interval_s
        self.device_interval_s = device_interval_s
        self.peak_rss: dict[str, int] = dict.fromkeys(self.pids, 0)
        self.peak_device: dict[str, int | None] = dict.fromkeys(self.pids)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ab-monitor", daemon=True)
        self._has_gpu = shutil.which("nvidia-smi") is not None

    def start(self) -> None:
        self._sample(device=self._has_gpu)
        self._thread.start()

    def _run(self) -> None:
        last_device = time.monotonic()
        while not self._stop.wait(self.interval_s):
            device = self._has_gpu and time.monotonic() - last_device >= self.device_interval_s
            if device:
                last_device = time.monotonic()
            self._sample(device)

    def _sample(self, device: bool) -> None:
        usage = device_bytes_by_pid() if device else {}
        for name, pid in self.pids.items():
            self.peak_rss[name] = max(self.peak_rss[name], tree_rss_bytes(pid))
            if device:
                used = sum(usage.get(p.pid, 0) for p in tree(pid))
                self.peak_device[name] = max(self.peak_device[name] or 0, used)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self._sample(device=self._has_gpu)
