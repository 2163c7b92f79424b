"""Sync servicers served by a grpc.aio server: each unary handler called inline on its loop.

The middlewares' servicers are sync code written against grpc's sync `ServicerContext`, and
the in-process placement calls the same methods; their handlers are microseconds of CPU (a
dev key's `Auth/CheckBatch` 3-4 µs, a router's `ResolveBatch` ~2 µs: `python -m bench.hop`).
On a sync server each call also crossed to a pool thread and back (the completion queue's
thread hands it to a handler thread, which wakes for it), and the pool grew a thread for each
call that found the others busy. Served here, a call is decided on the loop that read it and
answered from there: no Python thread between the socket and the servicer.

`SyncServicesOnLoop` is one generic handler for every service of the server, made from what
each service's generated `add_<Service>Servicer_to_server` registers (so the methods come
from the component's own table, and a new rpc needs nothing here). Per call it runs the
process's sync server interceptors (tracing's `TraceContextInterceptor`,
`runtime.allowed_peers.AllowedPeers`) exactly as grpc's sync server does, then calls the
intercepted handler with `LoopContext`, a sync `ServicerContext` over the call's aio context.

What can block never runs on the loop: a servicer whose rpc may wait (a disk write and its
fsync, a full ring's backpressure) says so per call with `may_block(rpc, request) -> bool`
(`services.logs.service.LogsService`); such a call runs on a thread (`asyncio.to_thread`, the
loop's default executor) and the loop keeps serving meanwhile. Without `may_block` every call
is inline: a servicer whose store calls (Redis, sqlite, Postgres) happen on its own threads,
off the request path (the rate limiter's leases and spend ledger, auth's key poller), has
nothing to declare.

Only unary rpcs: no middleware streams (the model and the Gateway do, and stay on the sync
server, `runtime.server`). A streaming rpc is refused when the server is made.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import grpc

from runtime.server import Interceptor
from services.common.loop_bound import call_on_its_loop
from services.component import ComponentSpec

Blocks = Callable[[Any], bool]  # request -> whether this call may wait on I/O

# A generic handler of any request and response (generic in grpc's stubs only).
if TYPE_CHECKING:
    GenericHandler = grpc.GenericRpcHandler[Any, Any]
else:
    GenericHandler = grpc.GenericRpcHandler


class _Aborted(Exception):
    """What `LoopContext.abort` raises, as grpc's sync `abort` raises: the handler stops there
    (an `Exception`, so a handler's own `except Exception` sees it as it would on a sync server)."""


class LoopContext:
    """A sync `grpc.ServicerContext` over a grpc.aio one, for a sync handler called on the loop
    (or, for a call that may block, on a thread while the loop awaits it).

    `abort` records the status and raises, as the sync one does; the call ends with that status
    once the handler is out (`answer`), even if the handler swallowed the exception, as on a
    sync server. `send_initial_metadata` is sent before the answer; `add_callback` runs when
    the call ends. Everything else is the aio context's own (the sync methods of the two share
    names and meanings: metadata, peer, auth context, deadline, code and details)."""

    def __init__(self, context: grpc.aio.ServicerContext[Any, Any], loop: asyncio.AbstractEventLoop) -> None:
        self._context = context
        self._loop = loop
        self._aborted: tuple[grpc.StatusCode, str, Any] | None = None
        self._initial: Any = None

    def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        if code == grpc.StatusCode.OK:  # an abort is a failure: grpc's sync one makes it UNKNOWN too
            code, details = grpc.StatusCode.UNKNOWN, ""
        if self._aborted is None:
            self._aborted = (code, details, None)
        raise _Aborted(details)

    def abort_with_status(self, status: Any) -> None:
        if self._aborted is None:
            self._aborted = (status.code, status.details, status.trailing_metadata)
        raise _Aborted(status.details)

    def send_initial_metadata(self, initial_metadata: Any) -> None:
        self._initial = tuple(initial_metadata)

    def add_callback(self, callback: Callable[[], object]) -> bool:
        def ended(_context: Any) -> None:
            callback()

        def registered() -> None:
            self._context.add_done_callback(ended)  # type: ignore[arg-type]  # grpc calls it with the context; the stubs say a class

        call_on_its_loop(self._loop, registered)
        return True

    def is_active(self) -> bool:
        return not self._context.done()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    @property
    def untouched(self) -> bool:
        """Whether the handler left nothing for `answer` to do (the common case: no abort)."""
        return self._aborted is None and self._initial is None

    async def answer(self, response: Any) -> Any:
        """End the call as the handler left it: its abort, else `response` (after any initial
        metadata it asked to send)."""
        if self._aborted is not None:
            code, details, trailing = self._aborted
            await self._context.abort(code, details, trailing_metadata=trailing or ())
        if self._initial is not None:
            await self._context.send_initial_metadata(self._initial)
        return response


class _Method(NamedTuple):
    handler: grpc.RpcMethodHandler[Any, Any]  # the sync one, as the service registered it
    blocks: Blocks | None
    on_loop: grpc.RpcMethodHandler[Any, Any]  # without interceptors: made once


class _CallDetails(grpc.HandlerCallDetails):
    """What a generic handler is asked for: a method (and the call's metadata: none here)."""

    def __init__(self, method: str) -> None:
        self.method = method
        self.invocation_metadata = ()


class _Registrations:
    """Stands in for a server while a generated `add_<Service>Servicer_to_server` registers."""

    def __init__(self) -> None:
        self.generic: list[GenericHandler] = []

    def add_generic_rpc_handlers(self, handlers: Sequence[GenericHandler]) -> None:
        self.generic.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: Any) -> None:
        pass  # the generic handlers above answer the same methods


class SyncServicesOnLoop(GenericHandler):
    """The generic handler of a grpc.aio server for sync `services` (spec, servicer), through
    the sync `interceptors`; each call inline on the server's loop unless it may block."""

    def __init__(self, services: Sequence[tuple[ComponentSpec[Any], Any]], interceptors: Sequence[Interceptor],
                 loop: asyncio.AbstractEventLoop) -> None:
        self._interceptors = tuple(interceptors)
        self._loop = loop
        self._methods: dict[str, _Method] = {}
        for spec, servicer in services:
            registered = _Registrations()
            spec.add_to_server(servicer, registered)
            may_block = getattr(servicer, "may_block", None)
            for method in spec.descriptor().methods:
                path = f"/{spec.full_name}/{method.name}"
                handler = next((found for generic in registered.generic
                                if (found := generic.service(_CallDetails(path))) is not None), None)
                if handler is None:
                    continue
                if handler.unary_unary is None:
                    raise TypeError(f"{path}: only unary rpcs are served on the event loop; a streaming "
                                    "one belongs on the thread-pool server (runtime.server.start_server)")
                blocks = None if may_block is None else _asking(may_block, method.name)
                self._methods[path] = _Method(handler, blocks, self._on_loop(handler, blocks))

    @property
    def methods(self) -> tuple[str, ...]:
        """The full paths it answers, e.g. `/spine.v1.Auth/CheckBatch`."""
        return tuple(self._methods)

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        method = self._methods.get(handler_call_details.method)
        if method is None:
            return None
        if not self._interceptors:
            return method.on_loop
        intercepted = self._intercept(0, handler_call_details, method.handler)
        if intercepted is None:
            return None
        return self._on_loop(intercepted, method.blocks)

    def _intercept(self, at: int, details: grpc.HandlerCallDetails,
                   handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any] | None:
        """The handler after interceptors [at:], each given the rest as its continuation, as
        grpc's sync server chains them."""
        if at == len(self._interceptors):
            return handler
        found: grpc.RpcMethodHandler[Any, Any] | None = self._interceptors[at].intercept_service(
            lambda next_details: self._intercept(at + 1, next_details, handler), details)
        return found

    def _on_loop(self, handler: grpc.RpcMethodHandler[Any, Any], blocks: Blocks | None) -> grpc.RpcMethodHandler[Any, Any]:
        assert handler.unary_unary is not None  # an interceptor keeps a unary rpc unary
        behaviour: Callable[[Any, Any], Any] = handler.unary_unary  # called with a `LoopContext`
        loop = self._loop

        async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            shim = LoopContext(context, loop)
            try:
                if blocks is not None and blocks(request):
                    response = await asyncio.to_thread(behaviour, request, shim)
                else:
                    response = behaviour(request, shim)
            except _Aborted:
                response = None
            if shim.untouched:
                return response
            return await shim.answer(response)

        return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)


def _asking(may_block: Callable[[str, Any], bool], rpc: str) -> Blocks:
    return lambda request: bool(may_block(rpc, request))
