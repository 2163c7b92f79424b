"""An event loop on a thread of its own, for the servers of a process's request path.

The spine serves its public gRPC API (the Gateway, `runtime.gateway_on_loop`) and its HTTP
API (`runtime.http.server`) from one loop: a request of either kind is read, decided and
answered on the thread that reads its socket, and the two share that loop's upstream
connection pools (`services.common.loop_bound`). A layered middleware's process serves its
gRPC server from one too (`runtime.loop_server`). The loop runs on a thread of its own, so
the process's main thread keeps waiting for its signals (`runtime.processes.signals`).

uvloop, as measured for both servers (bench/README.md, "The cost of a hop"): grpc.aio's calls
and uvicorn's parsing cost less CPU on it than on asyncio's own loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

from services.common.loop_bound import close_bound
from services.common.thread_names import name_os_thread

T = TypeVar("T")

# Threads of the loop's default executor: what a call hands off because it may block (a
# store's write, a log's fsync, an embedding's forward). Few: each waits on a disk or a core.
BLOCKING_THREADS = 4


class RequestLoop:
    """A uvloop event loop running on thread `name` until `stop`; `run` hands it work from
    any other thread. What requests opened on it (upstream connection pools) is closed on it
    before it ends (`close_bound`)."""

    def __init__(self, name: str) -> None:
        self.loop = uvloop.new_event_loop()
        self.loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(
            max_workers=BLOCKING_THREADS, thread_name_prefix=f"{name}-blocking", initializer=name_os_thread))
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        name_os_thread()  # the thread's name in the kernel too: the bench reads CPU by thread name
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.run_until_complete(close_bound())
            self.loop.run_until_complete(self.loop.shutdown_default_executor())
            self.loop.close()

    def on_loop_thread(self) -> bool:
        return threading.current_thread() is self.thread

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = 10.0) -> T:
        """Run `coroutine` on the loop from another thread and return its result (its
        exception raised here; TimeoutError after `timeout` seconds)."""
        if self.on_loop_thread():
            raise RuntimeError("RequestLoop.run from the loop's own thread would wait for itself")
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    @property
    def stopped(self) -> bool:
        return self.loop.is_closed() or not self.thread.is_alive()

    def stop(self, timeout: float = 5.0) -> None:
        """End the loop once what is scheduled now has run; idempotent."""
        if self.loop.is_closed():
            return
        try:
            self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:  # closed meanwhile
            return
        if not self.on_loop_thread():
            self.thread.join(timeout)
