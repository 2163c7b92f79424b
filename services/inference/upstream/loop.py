"""The event loop every upstream call runs on: one thread per process, started on first use.

The servicers are blocking code (a request holds a handler thread while the model works), and
the HTTP client is an async one (connection pools, keep-alive and HTTP/2 multiplexing want
one loop owning the sockets). So one loop thread owns every upstream connection of the
process, and a handler thread hands it a coroutine and waits for its result, or for the
pieces of a stream through a queue. uvloop where installed (a runtime dependency), as the
HTTP front's server uses.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from services.common.thread_names import name_os_thread

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover - uvloop is a runtime dependency
        return asyncio.new_event_loop()


def upstream_loop() -> asyncio.AbstractEventLoop:
    """The process's upstream loop, running in its own daemon thread (`upstream-io`)."""
    global _loop
    with _lock:
        if _loop is not None and not _loop.is_closed():
            return _loop
        loop = _new_loop()
        started = threading.Event()

        def run() -> None:
            name_os_thread()
            asyncio.set_event_loop(loop)
            loop.call_soon(started.set)
            loop.run_forever()

        threading.Thread(target=run, name="upstream-io", daemon=True).start()
        started.wait(10)
        _loop = loop
        return loop


def submit(coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """Run `coroutine` on the upstream loop; its future can be waited on (and cancelled) from any thread."""
    return asyncio.run_coroutine_threadsafe(coroutine, upstream_loop())


def call_soon(callback: Any, *args: Any) -> None:
    """Run `callback(*args)` on the upstream loop, from any thread."""
    upstream_loop().call_soon_threadsafe(callback, *args)
