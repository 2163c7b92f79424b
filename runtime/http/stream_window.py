"""A stream's chunks, from the handler thread that pulls them to the event loop that writes
them, with backpressure from the client's socket to the model.

uvicorn's `send` waits while the connection's write buffer is over its high-water mark, so
the event loop writes a stream no faster than the client reads it. Between the handler
thread and the loop at most `limit` chunks wait: past it the thread stops pulling the
stream (`put` waits), so the model (an upstream's stream, whose own queue is bounded the same
way, or the engine) is asked for no more. What a client that does not read can make the
server hold is therefore the socket's buffers plus `limit` chunks, however fast the model;
and once it has taken nothing for `http.stream_stall_s` the app cancels the request.
The stream's end, its error and the client's leaving always go in at once.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

LIMIT = 32  # chunks waiting for the event loop, per stream


class StreamWindow:
    """One stream: `put` from the handler thread, `end` from any thread, `get` on the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int = LIMIT) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._room = threading.Semaphore(limit)
        self._closed = threading.Event()

    def put(self, item: Any) -> bool:
        """`item` to the loop once there is room (the handler thread waits meanwhile); False
        once the stream is closed: the caller stops pulling it."""
        if self._closed.is_set():
            return False
        self._room.acquire()
        if self._closed.is_set():
            self._room.release()  # the wake goes on to whoever else waits
            return False
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        return True

    def end(self, item: Any) -> None:
        """The stream's last word (its end, its error, the client's leaving), without waiting."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def get(self) -> Any:
        item = await self._queue.get()
        self._room.release()
        return item

    def empty(self) -> bool:
        return self._queue.empty()

    def close(self) -> None:
        """Nothing more is taken: a handler thread waiting in `put` is let go (and told so)."""
        self._closed.set()
        # One release lets a waiting producer go, and it passes the wake on (`put`).
        # (`Semaphore.release(n)` notifies n times under its lock: a large n cost ~20 ms of the
        # event loop's CPU at the end of every stream.)
        self._room.release()
