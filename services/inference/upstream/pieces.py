"""A stream's pieces, from the upstream loop to the handler thread that relays them, bounded.

The loop reads an upstream as fast as it sends; the handler thread relays each piece to the
client only as fast as the client reads (a gRPC stream's flow control, the HTTP layer's own
bound). Between them at most `limit` pieces wait: past it the loop stops reading that
upstream (`put` waits for room), so its socket's receive window fills and TCP slows the engine
itself, and a client that does not read never makes this process buffer the whole answer.
The ends of a stream (its last None, a failure, the client's leaving) always go in at once.

Where the request is served on the event loop that reads the upstream (the HTTP front's, see
`services.gateway.service`), the reader is a coroutine on that loop (`get_on_loop`) instead of
a thread; the bound is the same.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections import deque
from typing import Any

from services.common.loop_bound import call_on_its_loop

LIMIT = 64  # pieces waiting for the handler thread, per stream


class Pieces:
    """One stream attempt's pieces: `put` (awaited) and `end` on the loop, `get` on a thread
    (or `get_on_loop` on an event loop)."""

    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = limit
        self._items: deque[Any] = deque()
        self._lock = threading.Condition()
        self._room: asyncio.Event | None = None  # the loop waits on it while the queue is full
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Event | None = None  # a reader on a loop waits on it while the queue is empty
        self._reader_loop: asyncio.AbstractEventLoop | None = None

    async def put(self, item: Any) -> None:
        """`item` in, once there is room (on the loop: the upstream is not read meanwhile)."""
        while True:
            with self._lock:
                if len(self._items) < self.limit:
                    self._items.append(item)
                    self._lock.notify()
                    self._wake_reader()
                    return
                if self._room is None:
                    self._room, self._loop = asyncio.Event(), asyncio.get_running_loop()
                self._room.clear()
                room = self._room
            await room.wait()

    def end(self, item: Any) -> None:
        """The stream's end, a failure, or the client's leaving: in at once, from any thread."""
        with self._lock:
            self._items.append(item)
            self._lock.notify()
            self._wake_reader()

    def get(self, timeout_s: float) -> Any:
        """The next piece; `queue.Empty` when none came within `timeout_s`."""
        with self._lock:
            if not self._lock.wait_for(lambda: self._items, timeout_s):
                raise queue.Empty
            return self._take()

    async def get_on_loop(self, timeout_s: float) -> Any:
        """`get` for a reader that is a coroutine on an event loop; `queue.Empty` likewise."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            with self._lock:
                if self._items:
                    return self._take()
                if self._ready is None:
                    self._ready, self._reader_loop = asyncio.Event(), loop
                self._ready.clear()
                ready = self._ready
            left = deadline - loop.time()
            if left <= 0:
                raise queue.Empty
            try:
                await asyncio.wait_for(ready.wait(), left)
            except TimeoutError:
                raise queue.Empty from None

    def _take(self) -> Any:
        """The next item (the lock held); the writer is woken if it waits for room."""
        item = self._items.popleft()
        if self._room is not None and not self._room.is_set() and len(self._items) < self.limit:
            assert self._loop is not None
            call_on_its_loop(self._loop, self._room.set)
        return item

    def _wake_reader(self) -> None:
        if self._ready is not None and not self._ready.is_set():
            assert self._reader_loop is not None
            call_on_its_loop(self._reader_loop, self._ready.set)
