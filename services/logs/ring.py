"""A preallocated ring of encoded log lines and the writer that flushes it in batches.

Why a ring and a flusher thread: a request must not wait for the disk. Appending is a copy of
a reference into a preallocated slot under a short lock; a background thread turns whatever
is pending into one `write()` + `fsync()` per batch, every `flush_interval_s` or as soon as
`batch_lines` lines are pending.

Nothing accepted is ever dropped. When the ring is full an append waits briefly for the
flusher, then flushes synchronously itself (backpressure instead of loss). A failed write keeps
its bytes and is retried first by the next flush; until it succeeds the ring is not drained, so
memory stays bounded and appenders see the error.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from services.common.thread_names import name_os_thread


class LogsClosedError(RuntimeError):
    """An append after `close()`: the writer has flushed everything and released its file."""


class LogRing:
    """Fixed-capacity FIFO of lines in preallocated slots. Not thread-safe: the writer locks."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: must be >= 1, got {capacity}")
        self._slots: list[bytes | None] = [None] * capacity
        self._head = 0  # oldest line
        self._size = 0

    @property
    def capacity(self) -> int:
        return len(self._slots)

    def __len__(self) -> int:
        return self._size

    def put(self, lines: Sequence[bytes], start: int = 0) -> int:
        """Append lines[start:] in order, as many as fit; returns how many were taken."""
        cap = len(self._slots)
        taken = min(len(lines) - start, cap - self._size)
        tail = (self._head + self._size) % cap
        for i in range(taken):
            self._slots[(tail + i) % cap] = lines[start + i]
        self._size += taken
        return taken

    def drain(self) -> list[bytes]:
        """Every pending line, oldest first; the ring is empty afterwards."""
        cap = len(self._slots)
        out: list[bytes] = []
        for i in range(self._size):
            slot = (self._head + i) % cap
            line = self._slots[slot]
            assert line is not None
            out.append(line)
            self._slots[slot] = None
        self._head = (self._head + self._size) % cap
        self._size = 0
        return out


class BatchedLineWriter:
    """Appends lines to a file through a `LogRing`, flushed by a background thread."""

    def __init__(
        self,
        path: Path,
        *,
        capacity: int = 4096,
        batch_lines: int = 64,
        flush_interval_s: float = 0.5,
        full_wait_s: float = 0.05,
        fsync: bool = True,
    ) -> None:
        if batch_lines < 1 or batch_lines > capacity:
            raise ValueError(f"batch_lines: must be in 1..capacity ({capacity}), got {batch_lines}")
        if flush_interval_s <= 0:
            raise ValueError(f"flush_interval_s: must be > 0, got {flush_interval_s}")
        self.path = path
        self._ring = LogRing(capacity)
        self._batch_lines = batch_lines
        self._interval = flush_interval_s
        self._full_wait = full_wait_s
        self._fsync = fsync

        self._lock = threading.Lock()  # ring, flags, counters
        self._not_full = threading.Condition(self._lock)
        self._wake = threading.Condition(self._lock)  # the flusher sleeps on this
        self._idle = threading.Condition(self._lock)  # close() waits for in-flight appends
        self._write_lock = threading.Lock()  # drain + write as one step keeps lines in order
        self._close_lock = threading.Lock()
        self._active = 0
        self._closed = False
        self._stopping = False
        self._unwritten = b""  # bytes of a failed write, retried first
        self._writes = 0
        self.last_error: OSError | None = None

        path.parent.mkdir(parents=True, exist_ok=True)
        # Request logs name tenants and models: readable by the owner only.
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._lines_on_disk = _count_lines(path)
        self._thread = threading.Thread(target=self._run, name=f"log-flusher:{path.name}", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    # -- accepting ------------------------------------------------------------------------

    def append(self, lines: Sequence[bytes]) -> None:
        """Accept `lines` (each ending in a newline), in order. Blocks while the ring is full.

        Raises LogsClosedError after close(), and OSError when the ring is full and the file
        cannot be written (lines taken before the error stay accepted and will be written).
        """
        with self._lock:
            if self._closed:
                raise LogsClosedError(f"request log {self.path} is closed")
            self._active += 1
        try:
            i = 0
            while i < len(lines):
                with self._lock:
                    took = self._ring.put(lines, i)
                    if not took:
                        self._wake.notify()
                        self._not_full.wait(self._full_wait)
                        took = self._ring.put(lines, i)
                    if len(self._ring) >= self._batch_lines:
                        self._wake.notify()
                i += took
                if not took:
                    self.flush()  # the flusher did not keep up: write in this thread
        finally:
            with self._lock:
                self._active -= 1
                if not self._active:
                    self._idle.notify_all()

    # -- writing --------------------------------------------------------------------------

    def flush(self) -> int:
        """Write everything pending now; returns the number of lines in the file."""
        with self._write_lock:
            if self._fd < 0:
                return self._lines_on_disk
            if self._unwritten:
                self._write(self._unwritten)
            with self._lock:
                lines = self._ring.drain()
                self._not_full.notify_all()
            if lines:
                self._write(b"".join(lines))
            return self._lines_on_disk

    def _write(self, data: bytes) -> None:
        """One batch: write() until done, then fsync; on failure keep what was not written."""
        view = memoryview(data)
        done = 0
        try:
            while done < len(data):
                done += os.write(self._fd, view[done:])
        except OSError:
            self._unwritten = data[done:]
            raise
        finally:
            self._lines_on_disk += data.count(b"\n", 0, done)
        self._unwritten = b""
        self._writes += 1
        if self._fsync:
            os.fsync(self._fd)

    def _run(self) -> None:
        name_os_thread()
        backoff = False
        while True:
            with self._lock:
                deadline = time.monotonic() + self._interval
                while not self._stopping and (backoff or len(self._ring) < self._batch_lines):
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._wake.wait(remaining)
                if self._stopping:
                    return
                if not len(self._ring) and not self._unwritten:
                    continue
            try:
                self.flush()
                backoff = False
            except OSError as exc:  # kept for retry; appenders see it when the ring fills
                self.last_error = exc
                backoff = True

    # -- state ----------------------------------------------------------------------------

    @property
    def lines_on_disk(self) -> int:
        return self._lines_on_disk

    def room(self) -> int:
        """Lines an append takes now without waiting: only appends take room, so for the one
        thread that appends (an event loop serving the logs) it is exact until its next append."""
        with self._lock:
            return self._ring.capacity - len(self._ring)

    @property
    def pending(self) -> int:
        """Lines accepted but not yet written."""
        with self._lock:
            return len(self._ring) + self._unwritten.count(b"\n")

    @property
    def writes(self) -> int:
        """Batches written so far (one write() + fsync each)."""
        return self._writes

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Refuse new lines, let in-flight appends finish, flush all, stop. Idempotent."""
        with self._close_lock:
            with self._lock:
                if self._stopping:
                    return
                self._closed = True
                while self._active:
                    self._idle.wait()
                self._stopping = True
                self._wake.notify_all()
            self._thread.join()
            atexit.unregister(self.close)
            try:
                self.flush()
            finally:
                with self._write_lock:
                    os.close(self._fd)
                    self._fd = -1


def _count_lines(path: Path) -> int:
    """Lines already in the file (it is appended to across restarts); 0 for a device or pipe."""
    if not path.is_file():
        return 0
    count = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            count += chunk.count(b"\n")
    return count
