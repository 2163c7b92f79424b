"""What was opened on an event loop and must be closed on it before the loop ends.

An async client's connection pool (aiohttp's session, httpx2's client) belongs to the loop
that made it: its sockets are that loop's, and it can be neither used nor closed from
another. A component called from several loops (the HTTP front's, where a request is served
from accept to answer, and the process's upstream loop for blocking callers) keeps one pool
per loop, made on first use (`PerLoop`); the code that runs a loop closes what was opened on
it before the loop ends (`close_bound`), so no socket outlives its loop and nothing is
closed from the wrong thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

log = logging.getLogger("spine.loops")

T = TypeVar("T")
Closer = Callable[[], Awaitable[object]]

_lock = threading.Lock()
_closers: dict[asyncio.AbstractEventLoop, list[Closer]] = {}


def bind(close: Closer) -> None:
    """Run `close()` on the running loop before it ends (the loop's owner calls `close_bound`)."""
    loop = asyncio.get_running_loop()
    with _lock:
        _closers.setdefault(loop, []).append(close)


async def close_bound() -> None:
    """Close everything bound to the running loop (called by the code that runs the loop, last)."""
    loop = asyncio.get_running_loop()
    with _lock:
        closers = _closers.pop(loop, [])
    for close in closers:
        try:
            await close()
        except Exception as error:  # closing must not stop the loop from ending
            log.warning("closing what was opened on an ending event loop: %r", error)


def call_on_its_loop(loop: asyncio.AbstractEventLoop, callback: Callable[[], object]) -> None:
    """Run `callback` on `loop` from any thread: at once when called on that loop, else handed
    to it (an event's `set`, a task's `cancel` may only run on their own loop's thread);
    nothing once the loop is closed."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        callback()
    elif not loop.is_closed():
        loop.call_soon_threadsafe(callback)


class PerLoop(Generic[T]):
    """One `T` per event loop, made by `make` on first use on that loop and closed by `close`
    either with the loop (`close_bound`) or by `aclose` on it."""

    def __init__(self, make: Callable[[], T], close: Callable[[T], Awaitable[object]]) -> None:
        self._make = make
        self._close = close
        self._by_loop: dict[asyncio.AbstractEventLoop, T] = {}
        self._lock = threading.Lock()

    def get(self) -> T:
        """The running loop's one (made now, on this loop, when it has none)."""
        loop = asyncio.get_running_loop()
        made = self._by_loop.get(loop)  # a dict read: safe without the lock
        if made is not None:
            return made
        made = self._make()
        with self._lock:
            self._by_loop = {**{k: v for k, v in self._by_loop.items() if not k.is_closed()}, loop: made}

        holder = weakref.ref(self)  # a component dropped before its loop ends is not kept alive by it

        async def close_with_loop() -> None:
            per_loop = holder()
            if per_loop is not None:
                await per_loop._drop(loop)

        bind(close_with_loop)
        return made

    def made(self) -> bool:
        """Whether any loop has one."""
        return bool(self._by_loop)

    async def aclose(self) -> None:
        """Close the running loop's one (each other loop's is closed when that loop ends)."""
        await self._drop(asyncio.get_running_loop())

    async def _drop(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            made = self._by_loop.get(loop)
            self._by_loop = {k: v for k, v in self._by_loop.items() if k is not loop}
        if made is not None:
            await self._close(made)
