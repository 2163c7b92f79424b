"""The Gateway's gRPC API served by grpc.aio, on the event loop the HTTP API runs on.

A gRPC call of `spine.v1.Gateway` is read, decided and answered on the process's request loop
(`runtime.request_loop`), the same way an HTTP request is (`runtime.http.app`): where every
step of the pipeline is in this process (`Gateway.serves_on_loop`: the spine's steps, the
model awaited on the loop), the gateway's own async interface is awaited there
(`generate_on_loop`, `generate_stream_on_loop`), its answer and headers coming back as
values; no thread stands between the socket and the model. On the thread-pool server each
call crossed from gRPC's poller to a handler thread, which then waited for the micro-batcher's
leader and the model's hand-offs (bench/README.md, "One event loop").

Anything else — a step or hook that may block (the layered gateway's steps are gRPC calls,
a mixed stage's remote components, an injected latency) — is the gateway's sync handler run
on a thread of this server's own pool (`grpc_N`, sized like the thread-pool server's:
`runtime.server.request_threads`), a stream's chunks crossing back through a bounded window
(`runtime.http.stream_window`). The choice is made per call: components move.

The call is handed to the gateway as a `LocalContext`: the caller's metadata, its deadline,
and its cancellation. grpc.aio cancels a call's task when its client goes away (or its
deadline passes); that cancellation also cancels the `LocalContext`, whose callbacks stop the
model's work at once, as a client's hang-up does over HTTP. A verdict (`grpc.RpcError`) ends
the call with its code, details and trailers; an answer's trailers are set from the values
the gateway returned.

The process's server interceptors (tracing's) cannot wrap an async handler: each offers the
span it would have opened around the call (`around`), and it is opened here, on either path.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import grpc

from runtime.http.stream_window import StreamWindow
from runtime.server import Interceptor
from runtime.sync_on_loop import GenericHandler
from services.common.thread_names import name_os_thread
from services.gateway.service import Gateway
from services.gateway.wire import Undecodable, lenient, refusal
from services.pipeline.limits import NO_DEADLINE_S
from services.pipeline.local_context import LocalContext
from services.pipeline.pipeline import code_details
from wire.v1 import generation_pb2

_UNTRACED = contextlib.nullcontext()
GENERATE = "/spine.v1.Gateway/Generate"
GENERATE_STREAM = "/spine.v1.Gateway/GenerateStream"

AioContext = grpc.aio.ServicerContext[Any, Any]


class Spans(Protocol):
    """What a server interceptor offers a handler it cannot wrap: the span of a call."""

    def around(self, method: str, metadata: Sequence[Any]) -> contextlib.AbstractContextManager[Any]: ...


class _End:
    """A blocking stream's end in the window: None, or the verdict that ended it."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


class GatewayOnLoop(GenericHandler):
    """The generic handler of `spine.v1.Gateway` for a grpc.aio server on the request loop."""

    def __init__(self, gateway: Gateway, *, threads: int, interceptors: Sequence[Interceptor] = ()) -> None:
        spans: list[Spans] = []
        for interceptor in interceptors:
            if not callable(getattr(interceptor, "around", None)):
                raise TypeError(f"{type(interceptor).__name__} cannot wrap the Gateway's calls on the event loop: "
                                "give it an `around(method, metadata)` context manager")
            spans.append(interceptor)  # type: ignore[arg-type]  # checked just above
        self.gateway = gateway
        self._spans = tuple(spans)
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grpc", initializer=name_os_thread)
        request = lenient(generation_pb2.GenerateRequest.FromString)  # an undecodable body is bad input
        self._handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
            GENERATE: grpc.unary_unary_rpc_method_handler(
                self._generate, request_deserializer=request,
                response_serializer=generation_pb2.GenerateResponse.SerializeToString),
            GENERATE_STREAM: grpc.unary_stream_rpc_method_handler(
                self._generate_stream, request_deserializer=request,
                response_serializer=generation_pb2.GenerateChunk.SerializeToString),
        }

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        return self._handlers.get(handler_call_details.method)

    def close(self) -> None:
        """Let the handler threads go (after the server has stopped: nothing waits on them)."""
        self.pool.shutdown(wait=False, cancel_futures=True)

    # -- the rpcs -------------------------------------------------------------------------
    async def _generate(self, request: generation_pb2.GenerateRequest,
                        context: AioContext) -> generation_pb2.GenerateResponse:
        metadata = tuple(context.invocation_metadata() or ())
        if isinstance(request, Undecodable):
            await context.abort(*self._refused(request, metadata))
        local = _local_context(context, metadata)
        with self._traced(GENERATE, metadata):
            try:
                if self.gateway.serves_on_loop(request):
                    response, trailing = await self.gateway.generate_on_loop(request, local, self._offload)
                else:
                    response = await self._offload(self.gateway.Generate, request, local)
                    trailing = local.trailing_metadata()
            except grpc.RpcError as error:
                code, details, trailers = code_details(error)
                await context.abort(code, details, trailing_metadata=trailers)
            except (asyncio.CancelledError, GeneratorExit):
                local.cancel(_why_left(local))
                raise
        context.set_trailing_metadata(trailing)
        return response

    async def _generate_stream(self, request: generation_pb2.GenerateRequest,
                               context: AioContext) -> AsyncIterator[generation_pb2.GenerateChunk]:
        metadata = tuple(context.invocation_metadata() or ())
        if isinstance(request, Undecodable):
            await context.abort(*self._refused(request, metadata))
        local = _local_context(context, metadata)
        with self._traced(GENERATE_STREAM, metadata):
            if self.gateway.serves_on_loop(request):
                chunks = self.gateway.generate_stream_on_loop(request, local, self._offload)
            else:
                chunks = self._blocking_stream(request, local)
            try:
                async for chunk in chunks:
                    yield chunk
            except grpc.RpcError as error:
                code, details, trailers = code_details(error)
                await context.abort(code, details, trailing_metadata=trailers)
            except (asyncio.CancelledError, GeneratorExit):  # the client left: the model stops now
                local.cancel(_why_left(local))
                raise
            finally:
                await chunks.aclose()
        context.set_trailing_metadata(local.trailing_metadata())

    def _refused(self, request: Undecodable, metadata: Sequence[Any]) -> tuple[grpc.StatusCode, str, Any]:
        """INVALID_ARGUMENT with the usual trailers, as for any bad input (`services.gateway.wire`)."""
        return refusal(self.gateway.layout, request, metadata)

    # -- what runs on the handler pool ----------------------------------------------------
    def _offload(self, function: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        """`function(*args)` on a handler thread, in this call's context (its trace span)."""
        call = contextvars.copy_context()
        return asyncio.get_running_loop().run_in_executor(self.pool, call.run, function, *args)

    async def _blocking_stream(self, request: generation_pb2.GenerateRequest,
                               local: LocalContext) -> AsyncGenerator[generation_pb2.GenerateChunk, None]:
        """The gateway's sync stream pulled on a handler thread, its chunks handed to the loop
        through a bounded window (the thread stops pulling while the client reads nothing)."""
        window = StreamWindow(asyncio.get_running_loop())
        pulled = self._offload(self._pump, request, local, window)
        try:
            while True:
                item = await window.get()
                if isinstance(item, _End):
                    if item.error is not None:
                        raise item.error
                    return
                yield item
        finally:
            window.close()  # the thread stops pulling, whatever ended this
            pulled.cancel()  # one not started yet never starts

    def _pump(self, request: generation_pb2.GenerateRequest, local: LocalContext, window: StreamWindow) -> None:
        chunks: Iterator[generation_pb2.GenerateChunk] = iter(())
        try:
            chunks = self.gateway.GenerateStream(request, local)
            for chunk in chunks:
                if not window.put(chunk):
                    local.cancel(_why_left(local))  # the client left: the model stops with the stream
                    return
            window.end(_End())
        except Exception as error:  # a verdict, or the gateway's failure: the call ends with it
            window.end(_End(error))
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()

    def _traced(self, method: str, metadata: Sequence[Any]) -> contextlib.AbstractContextManager[Any]:
        """The interceptors' spans around the call (nothing to open without tracing)."""
        if not self._spans:
            return _UNTRACED
        if len(self._spans) == 1:
            return self._spans[0].around(method, metadata)
        spans = contextlib.ExitStack()
        for interceptor in self._spans:
            spans.enter_context(interceptor.around(method, metadata))
        return spans


def _local_context(context: AioContext, metadata: tuple[Any, ...]) -> LocalContext:
    """The call as the gateway reads it: metadata, deadline (on the monotonic clock), the time it arrived."""
    remaining = context.time_remaining()
    deadline = None if remaining is None or remaining > NO_DEADLINE_S else time.monotonic() + max(0.0, remaining)
    return LocalContext(metadata, deadline, arrived=time.perf_counter())


def _why_left(local: LocalContext) -> str:
    """What a call grpc.aio ended early says in the request's record: its deadline, or the client."""
    remaining = local.time_remaining()
    return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"
