"""A stream's pieces, from the upstream loop to the handler thread that relays them, bounded.

The loop reads an upstream as fast as it sends; the handler thread relays each piece to the
client only as fast as the client reads (a gRPC stream's flow control, the HTTP layer's own
bound). Between them at most `limit` pieces wait: past it the loop stops reading that
upstream (`put` waits for room), so its socket's receive window fills and TCP slows the engine
itself, and a client that does not read never makes this process buffer the whole answer.
The ends of a stream (its last None, a failure, the client's leaving) always go in at once.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections import deque
from typing import Any

LIMIT = 64  # pieces waiting for the handler thread, per stream


class Pieces:
    """One stream attempt's pieces: `put` (awaited) and `end` on the loop, `get` on a thread."""

    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = limit
        self._items: deque[Any] = deque()
        self._lock = threading.Condition()
        self._room: asyncio.Event | None = None  # the loop waits on it while the queue is full
        self._loop: asyncio.AbstractEventLoop | None = None

    async def put(self, item: Any) -> None:
        """`item` in, once there is room (on the loop: the upstream is not read meanwhile)."""
        while True:
            with self._lock:
                if len(self._items) < self.limit:
                    self._items.append(item)
                    self._lock.notify()
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

    def get(self, timeout_s: float) -> Any:
        """The next piece; `queue.Empty` when none came within `timeout_s`."""
        with self._lock:
            if not self._lock.wait_for(lambda: self._items, timeout_s):
                raise queue.Empty
            item = self._items.popleft()
            if self._room is not None and not self._room.is_set() and len(self._items) < self.limit:
                assert self._loop is not None
                self._loop.call_soon_threadsafe(self._room.set)
            return item
