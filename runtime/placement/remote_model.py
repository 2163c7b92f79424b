"""The model in another process, awaited on the caller's event loop.

The layered gateway (and a spine whose model has not moved in yet) reaches the inference
component over gRPC. A request the HTTP API serves on its event loop awaits the model's
answer there too (`services.inference.api.OnLoop`): the whole answer, or the stream read
message by message, on the loop's grpc.aio stub (`RemoteComponent._unary_on_loop`), with
the same budget, outlier record, cancel and `abandon` as a call from a thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from runtime.placement.remote import LoopCall, RemoteComponent
from services.inference.api import GENERATE, GENERATE_STREAM, Generated
from services.pipeline.interface import NO_OPTIONS, CallOptions
from services.pipeline.local_call import status_of
from services.pipeline.local_context import LocalRpcError
from wire.v1 import generation_pb2


class RemoteModel(RemoteComponent):
    """The inference component's proxy: `OnLoop` besides the interface's operations."""

    def on_loop(self, model: str) -> bool:
        """Every model of a remote inference process is a network call: awaited on the loop
        whenever this proxy can open a channel there."""
        return self.awaits_on_loop

    async def generate_on_loop(self, request: generation_pb2.GenerateRequest,
                               options: CallOptions = NO_OPTIONS) -> Generated:
        answer, trailing = await self._unary_on_loop(GENERATE.rpc, GENERATE.encode(request), options)
        generated: Generated = GENERATE.decode(answer, trailing)
        return generated

    def generate_stream_on_loop(self, request: generation_pb2.GenerateRequest,
                                options: CallOptions = NO_OPTIONS) -> RemoteStreamOnLoop:
        self._admit()
        loop = asyncio.get_running_loop()
        call = getattr(self._loop_stub(loop), GENERATE_STREAM.rpc)(request, timeout=options.timeout,
                                                                   metadata=tuple(options.metadata) or None)
        handle = LoopCall(call, loop)
        self._track(handle)
        if options.parent is not None:
            options.parent.add_callback(handle.cancel)

        def ended(code: grpc.StatusCode, error: BaseException | None) -> str | None:
            self._record(code, options.timeout, error)
            return self._untrack(handle)

        return RemoteStreamOnLoop(handle, ended, self._gone)


class RemoteStreamOnLoop:
    """`RemoteStream` read on the loop: each chunk awaited from the aio call; its final status
    reported once; a stream abandoned because the component stopped answering ends UNAVAILABLE.
    The initial metadata is read with the first chunk and the trailers at the end, so both
    are values when the gateway asks for them."""

    def __init__(self, handle: LoopCall, on_end: Any, gone: Any) -> None:
        self._handle = handle
        self._call = handle.call
        self._on_end = on_end
        self._gone = gone
        self._ended = False
        self._initial: Sequence[tuple[str, str]] = ()
        self._trailing: Sequence[tuple[str, str]] = ()
        self._first = True

    def __aiter__(self) -> AsyncIterator[generation_pb2.GenerateChunk]:
        return self

    async def __anext__(self) -> generation_pb2.GenerateChunk:
        try:
            chunk = await self._call.read()
            if chunk is grpc.aio.EOF:  # type: ignore[attr-defined]  # the stubs miss it
                self._trailing = tuple(await self._call.trailing_metadata() or ())
                self._end(grpc.StatusCode.OK)
                raise StopAsyncIteration
            if self._first:
                self._first = False
                self._initial = tuple(await self._call.initial_metadata() or ())
            return chunk  # type: ignore[no-any-return]
        except grpc.RpcError as error:
            trailing: Any = getattr(error, "trailing_metadata", None)
            self._trailing = tuple(trailing() or ()) if callable(trailing) else ()
            reason = self._end(status_of(error), error)
            if reason is not None:
                raise self._gone(reason) from error
            raise
        except asyncio.CancelledError as error:
            if not self._handle.cancelled:  # the task itself was cancelled
                self._end(grpc.StatusCode.CANCELLED)
                raise
            reason = self._end(grpc.StatusCode.CANCELLED)
            if reason is not None:
                raise self._gone(reason) from error
            raise LocalRpcError(grpc.StatusCode.CANCELLED, "Cancelled by the caller") from error

    async def cancel(self) -> bool:
        self._end(grpc.StatusCode.CANCELLED)
        self._handle.cancel()
        return True

    def initial_metadata(self) -> Sequence[tuple[str, str]]:
        return self._initial

    def trailing_metadata(self) -> Sequence[tuple[str, str]]:
        return self._trailing

    def _end(self, code: grpc.StatusCode, error: BaseException | None = None) -> str | None:
        if self._ended:
            return None
        self._ended = True
        result: str | None = self._on_end(code, error)
        return result
