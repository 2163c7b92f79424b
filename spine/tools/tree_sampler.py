"""Measuring a layout's process tree: CPU seconds, resident memory, GPU memory, per-thread CPU.

A layout is a process tree (the spine alone, or a gateway and its children), so every
figure sums the whole tree; a process that exits while it is looked at is skipped. One
sampler for the bench and `spine ab`: `TreeSampler` keeps each tree's peaks in the
background, overall and per label (the run being measured at the moment).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Mapping

import psutil

from runtime.processes.launch import process_tree


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its descendants alive now (children that
    exited are lost: read it around a measured round, while the tree is up)."""
    total = 0.0
    for process in process_tree(pid):
        with contextlib.suppress(psutil.Error):
            times = process.cpu_times()
            total += times.user + times.system
    return total


def tree_rss_bytes(pid: int) -> int:
    """Resident memory summed over the tree (shared pages count once per process)."""
    total = 0
    for process in process_tree(pid):
        with contextlib.suppress(psutil.Error):
            total += process.memory_info().rss
    return total


def tree_thread_cpu_seconds(pid: int) -> dict[tuple[int, int], tuple[str, float]]:
    """Each thread of the tree alive now: (pid, thread id) -> (its kernel name, CPU seconds
    so far). Subtract two readings around a round.

    From /proc/PID/task/TID/schedstat (nanoseconds on a CPU), not the per-thread
    utime/stime: those come in 10 ms ticks, and a round spreads a few ms over each of
    dozens of handler threads."""
    out: dict[tuple[int, int], tuple[str, float]] = {}
    for proc in process_tree(pid):
        try:
            tids = os.listdir(f"/proc/{proc.pid}/task")
        except OSError:
            continue  # it ended meanwhile
        for tid in tids:
            try:
                with open(f"/proc/{proc.pid}/task/{tid}/comm") as comm:
                    name = comm.read().strip()
                with open(f"/proc/{proc.pid}/task/{tid}/schedstat") as schedstat:
                    on_cpu_ns = int(schedstat.read().split()[0])
            except (OSError, ValueError, IndexError):
                continue  # it ended meanwhile
            out[(proc.pid, int(tid))] = (name, on_cpu_ns / 1e9)
    return out


def memory_rollup(pid: int) -> dict[str, int]:
    """One process's proportional and resident set sizes in kB (/proc/PID/smaps_rollup): PSS
    counts a page shared by N processes as 1/N in each, so it tells what sharing saves."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        for line in rollup.read().splitlines()[1:]:
            name, _, rest = line.partition(":")
            fields[name] = int(rest.split()[0])  # kB
    return {"pss_kb": fields["Pss"], "rss_kb": fields["Rss"]}


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


class TreeSampler:
    """Samples each named tree's resident memory (and GPU memory, with `device` and a GPU) in
    the background, for peaks: per name (`peak_rss`, `peak_device`) and per label
    (`peak_by_label`: the label `measuring` set for that name, so each run gets the peak of
    its own layout while it was under load). Several names may share one root PID."""

    def __init__(self, pids: Mapping[str, int], interval_s: float = 0.1, *, device: bool = False,
                 device_interval_s: float = 1.0) -> None:
        self.pids = dict(pids)
        self.interval_s = interval_s
        self.device_interval_s = device_interval_s
        self.peak_rss: dict[str, int] = dict.fromkeys(self.pids, 0)
        self.peak_device: dict[str, int | None] = dict.fromkeys(self.pids)
        self.peak_by_label: dict[str, int] = {}
        self._labels: dict[str, str] = {}  # name -> the run being measured on it now
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-sampler", daemon=True)
        self._device = device and shutil.which("nvidia-smi") is not None

    def start(self) -> TreeSampler:
        self._sample(device=self._device)
        self._thread.start()
        return self

    def measuring(self, name: str, label: str | None) -> None:
        """From now on, `name`'s samples count for `label` too (None: for no label)."""
        with self._lock:
            if label:
                self._labels[name] = label
            else:
                self._labels.pop(name, None)
        if label:
            self._sample_one(name, None)

    def _run(self) -> None:
        last_device = time.monotonic()
        while not self._stop.wait(self.interval_s):
            device = self._device and time.monotonic() - last_device >= self.device_interval_s
            if device:
                last_device = time.monotonic()
            self._sample(device)

    def _sample(self, device: bool) -> None:
        usage = device_bytes_by_pid() if device else None
        for name in self.pids:
            self._sample_one(name, usage)

    def _sample_one(self, name: str, usage: dict[int, int] | None) -> None:
        pid = self.pids[name]
        rss = tree_rss_bytes(pid)
        with self._lock:
            self.peak_rss[name] = max(self.peak_rss[name], rss)
            label = self._labels.get(name)
            if label is not None:
                self.peak_by_label[label] = max(self.peak_by_label.get(label, 0), rss)
            if usage is not None:
                used = sum(usage.get(p.pid, 0) for p in process_tree(pid))
                self.peak_device[name] = max(self.peak_device[name] or 0, used)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self._sample(device=self._device)
