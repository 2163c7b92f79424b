"""A gRPC server on one event loop: how a layered middleware's process serves.

A middleware's handler is microseconds of CPU; on the thread-pool server
(`runtime.server.start_server`) each call also crossed to a handler thread and back, and a
burst grew the pool by a thread per call that found the others busy. Here one grpc.aio
server reads, decides and answers every call on its loop's thread (`grpc-loop`, uvloop): the
sync servicers and the process's sync interceptors are called inline through
`runtime.sync_on_loop`, and what may block (a servicer's `may_block`) goes to a thread of its
own. The layered layout's cost is then its hops, not Python threads, so the baseline the
spine is compared with is a fair one. Measured (`python -m bench.hop`, bench/README.md, "The
cost of a hop"): a hop is gRPC Python's own per-call work either way (~0.2-0.4 ms of the
child's CPU against a handler's few µs); the loop takes the handler threads out at the same
CPU per call.

Everything a thread-pool server offers is here too, the same way: health (grpc's asyncio
`HealthServicer`, its statuses set from any thread with `set_serving`) and reflection, TLS
and mTLS with the same rotating credentials (`runtime.tls.add_port`), the metadata limit and
message sizes (`runtime.server.server_options`), a plaintext health-only probe listener on
the same loop, and a graceful stop (NOT_SERVING at once, calls in flight finish within the
grace). The loop runs on a thread of its own, so the process's main thread keeps waiting
for its signals as before (`runtime.processes.signals.Termination`).

The model's process and the gateway's stay on the thread-pool server: their handlers wait
for the model (a request holds its thread while it is queued and decoded), which is what
that server's sizing is for (`runtime.server.request_pool`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import uvloop
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from runtime.config.sections import TlsConfig
from runtime.server import (
    Interceptor,
    bound_address,
    check_listen,
    default_interceptors,
    served_names,
    server_options,
)
from runtime.sync_on_loop import SyncServicesOnLoop
from runtime.tls import add_port
from services.common.thread_names import name_os_thread
from services.component import ComponentSpec

T = TypeVar("T")

LOOP_THREAD = "grpc-loop"
# Threads for the calls a servicer says may block (`runtime.sync_on_loop`): a log flush's
# fsync, a full ring's wait. Few: they are the exception, and each one waits on a disk.
BLOCKING_THREADS = 4


class _CheckOnly(health_pb2_grpc.HealthServicer):
    """`Health/Check` from the server's health servicer, on the probe listener; `Watch` stays
    UNIMPLEMENTED there, as on the thread-pool server's (`runtime.server._CheckOnly`)."""

    def __init__(self, health: HealthServicer) -> None:
        self._health = health

    async def Check(self, request: Any, context: Any) -> Any:
        return await self._health.Check(request, context)


@dataclass
class LoopServer:
    """A started event-loop server; its methods may be called from any thread."""

    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    server: grpc.aio.Server
    address: str  # what a client dials: "unix:/path" or "127.0.0.1:PORT"
    health: HealthServicer
    probe: grpc.aio.Server | None = None  # the health service alone, in plaintext (`probe_listen`)
    probe_address: str | None = None
    handlers: SyncServicesOnLoop | None = field(default=None, repr=False)
    _pending: set[asyncio.Task[Any]] = field(default_factory=set, repr=False)  # kept until done

    def set_serving(self, serving: bool, service: str = "") -> None:
        """Set `service`'s health status (from the loop's thread it is set as soon as the loop
        gets to it; from any other thread, before this returns)."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        self._on_loop(self.health.set(service, status))

    def stop(self, grace: float = 2.0) -> None:
        """NOT_SERVING at once, no new calls, the calls in flight finish within `grace`
        seconds; then the loop ends. Idempotent."""
        if self.loop.is_closed():
            return

        async def stopping() -> None:
            await self.health.enter_graceful_shutdown()
            await self.server.stop(grace)
            if self.probe is not None:
                await self.probe.stop(0)

        try:
            self._on_loop(stopping(), timeout=grace + 5.0)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=grace + 5.0)

    def _on_loop(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = 10.0) -> None:
        if threading.current_thread() is self.thread:
            task = self.loop.create_task(coroutine)
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)
            return
        asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)


def start_loop_server(
    services: Sequence[tuple[ComponentSpec[Any], Any]],
    listen: str,
    *,
    max_message_bytes: int = 1 << 20,
    max_concurrent_rpcs: int | None = None,
    allow_external: bool = False,
    interceptors: Sequence[Interceptor] | None = None,
    tls: TlsConfig | None = None,
    probe_listen: str | None = None,
) -> LoopServer:
    """Serve sync `services` (spec, servicer: unary rpcs only) on `listen` from one event loop,
    started on a thread of its own. The keywords mean what they mean to
    `runtime.server.start_server` (`interceptors`: sync server interceptors, the process's
    by default); AddressError or ConfigError before anything is left running."""
    check_listen(listen, allow_external)
    if probe_listen is not None:
        check_listen(probe_listen, allow_external)
    chain = tuple(default_interceptors() if interceptors is None else interceptors)
    # uvloop, as the HTTP front's: measured with `python -m bench.hop`, grpc.aio's calls cost
    # the loop less CPU on it than on asyncio's own (bench/README.md, "The cost of a hop").
    loop = uvloop.new_event_loop()
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(
        max_workers=BLOCKING_THREADS, thread_name_prefix="grpc-blocking", initializer=name_os_thread))
    thread = threading.Thread(target=_run, args=(loop,), name=LOOP_THREAD, daemon=True)
    thread.start()
    started = asyncio.run_coroutine_threadsafe(
        _start(services, listen, loop, thread, chain, max_message_bytes=max_message_bytes,
               max_concurrent_rpcs=max_concurrent_rpcs, tls=tls, probe_listen=probe_listen), loop)
    try:
        running = started.result()
    except BaseException:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        raise
    for spec, _ in services:
        running.set_serving(True, spec.full_name)
    return running


def _run(loop: asyncio.AbstractEventLoop) -> None:
    name_os_thread()
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()


async def _start(services: Sequence[tuple[ComponentSpec[Any], Any]], listen: str, loop: asyncio.AbstractEventLoop,
                 thread: threading.Thread, interceptors: Sequence[Interceptor], *, max_message_bytes: int,
                 max_concurrent_rpcs: int | None, tls: TlsConfig | None, probe_listen: str | None) -> LoopServer:
    handlers = SyncServicesOnLoop(services, interceptors, loop)
    # grpc.aio's first server starts its completion-queue poller thread from this one, and a
    # new thread takes its creator's name in the kernel: named apart, a profile tells them apart.
    name_os_thread("grpc-aio-poll")
    server = grpc.aio.server(handlers=[handlers], options=server_options(max_message_bytes),
                             maximum_concurrent_rpcs=max_concurrent_rpcs)
    name_os_thread()
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(served_names(services), server)
    try:
        port = add_port(server, listen, tls)  # type: ignore[arg-type]  # grpc.aio.Server binds the same way
    except RuntimeError:  # grpc's "Failed to bind to address"
        port = 0
    address = bound_address(listen, port)
    await server.start()
    running = LoopServer(loop, thread, server, address, health, handlers=handlers)
    if probe_listen is not None:
        try:
            running.probe, running.probe_address = await _start_probe(health, probe_listen)
        except BaseException:
            await server.stop(0)
            raise
    return running


async def _start_probe(health: HealthServicer, listen: str) -> tuple[grpc.aio.Server, str]:
    """The health service alone, in plaintext, on `listen` (`runtime.server.start_probe_server`'s twin)."""
    probe = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(_CheckOnly(health), probe)
    try:
        port = probe.add_insecure_port(listen)
    except RuntimeError:
        port = 0
    address = bound_address(listen, port, "--probe-listen")
    await probe.start()
    return probe, address
