"""The gateway's calls of the model: through its interface, as placed now, under the hooks,
as GenAI operations.

A request's model call is the one call the gateway makes outside a step's batch (the
engine batches decode steps itself), so it runs the pipeline's hooks itself
(`Pipeline.begin_call`): the span and an injected fault are the same in every placement.
A stream reports how it ended to the hooks once: at its last chunk, its error, or its cancel.

What the gateway notes of each call on `RequestState.model_call` — when it began, a
stream's first chunk, when the answer or the last chunk went out — and the answer itself give
the same GenAI span and metrics in both layouts. The span is the runtime's
(`runtime.observability.genai_spans`, the gateway's `genai` while tracing is on); the metrics are the
metrics component's, from each request's record (`services.metrics.genai`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any, Protocol

import grpc

from services.common.tenant_shares import tenant_metadata
from services.inference.api import INFERENCE, AsyncChunkStream, ChunkStream, Generated, OnLoop
from services.pipeline.interface import CallOptions
from services.pipeline.local_call import status_of
from services.pipeline.pipeline import CallHooks, Pipeline
from services.pipeline.state import RequestState
from wire.v1 import generation_pb2


class ModelCallSpans(Protocol):
    """Traces the model calls (the GenAI inference span): `calling` around the call, which
    starts the span and makes it the current one (the call's own span is its child);
    `end` when the request ends (a stream: after its last chunk), from `state.model_call`
    and the answer. Must never raise."""

    def calling(self, state: RequestState) -> contextlib.AbstractContextManager[Any]: ...

    def end(self, state: RequestState) -> None: ...


NOT_TRACED = contextlib.nullcontext()  # the call's context while tracing is off


def first_chunk(state: RequestState) -> None:
    """A stream's first chunk came: its time to first chunk, from the call's start."""
    call = state.model_call
    if call is not None:
        call.first_chunk_s = time.perf_counter() - call.started


def generate(pipeline: Pipeline, state: RequestState, parent: Any,
             genai: ModelCallSpans | None = None) -> Generated:
    """The whole answer to `state`'s routed request; a `grpc.RpcError` as the wire would."""
    with NOT_TRACED if genai is None else genai.calling(state):  # the GenAI span, current
        hooks = pipeline.begin_call(pipeline.model, state)
        code = grpc.StatusCode.OK
        try:
            assert state.resolved is not None
            return pipeline.components.get(INFERENCE).generate(state.resolved, _options(state, hooks, parent))
        except grpc.RpcError as error:
            code = status_of(error)
            raise
        except BaseException:
            code = grpc.StatusCode.UNKNOWN
            raise
        finally:
            hooks.end(code)


async def generate_on_loop(pipeline: Pipeline, state: RequestState, parent: Any, model: OnLoop,
                           genai: ModelCallSpans | None = None) -> Generated:
    """`generate`, awaited on the caller's event loop from `model` (the placed inference
    component, whose `on_loop` named the routed model): the same hooks, span and errors."""
    with NOT_TRACED if genai is None else genai.calling(state):
        hooks = pipeline.begin_call(pipeline.model, state)
        code = grpc.StatusCode.OK
        try:
            assert state.resolved is not None
            return await model.generate_on_loop(state.resolved, _options(state, hooks, parent))
        except grpc.RpcError as error:
            code = status_of(error)
            raise
        except BaseException:
            code = grpc.StatusCode.UNKNOWN
            raise
        finally:
            hooks.end(code)


def generate_stream(pipeline: Pipeline, state: RequestState, parent: Any,
                    genai: ModelCallSpans | None = None) -> ChunkStream:
    """The answer to `state`'s routed request, chunk by chunk."""
    with NOT_TRACED if genai is None else genai.calling(state):
        hooks = pipeline.begin_call(pipeline.model, state)
        try:
            assert state.resolved is not None
            stream = pipeline.components.get(INFERENCE).generate_stream(state.resolved,
                                                                        _options(state, hooks, parent))
        except grpc.RpcError as error:
            hooks.end(status_of(error))
            raise
    return _Reported(stream, hooks)


def generate_stream_on_loop(pipeline: Pipeline, state: RequestState, parent: Any, model: OnLoop,
                            genai: ModelCallSpans | None = None) -> _ReportedOnLoop:
    """`generate_stream`, read on the caller's event loop from `model` (whose `on_loop` named
    the routed model): the same hooks, span and errors."""
    with NOT_TRACED if genai is None else genai.calling(state):
        hooks = pipeline.begin_call(pipeline.model, state)
        try:
            assert state.resolved is not None
            stream = model.generate_stream_on_loop(state.resolved, _options(state, hooks, parent))
        except grpc.RpcError as error:
            hooks.end(status_of(error))
            raise
    return _ReportedOnLoop(stream, hooks)


# How a caller on an event loop runs blocking work (a built-in model's call) off its loop:
# `offload(function, *args)`, awaited (the HTTP front's handler pool).
Offload = Callable[..., Awaitable[Any]]


async def answer_on_loop(pipeline: Pipeline, state: RequestState, parent: Any, offload: Offload,
                         genai: ModelCallSpans | None = None) -> Generated:
    """The whole answer for a caller on an event loop: awaited there from a placed model that
    can answer on it (`OnLoop`: the spine's own router answers every model there); a placed
    model that cannot holds a thread while it works, so it goes to `offload`."""
    model: Any = pipeline.components.get(INFERENCE)
    on_loop = getattr(model, "on_loop", None)
    assert state.resolved is not None
    if on_loop is not None and on_loop(state.resolved.model):
        return await generate_on_loop(pipeline, state, parent, model, genai)
    answer: Generated = await offload(generate, pipeline, state, parent, genai)
    return answer


def stream_on_loop(pipeline: Pipeline, state: RequestState, parent: Any, offload: Offload,
                   genai: ModelCallSpans | None = None) -> AsyncChunkStream:
    """The stream for a caller on an event loop: read there from a model that can answer on
    it, else the model's blocking stream read a chunk at a time through `offload`."""
    model: Any = pipeline.components.get(INFERENCE)
    on_loop = getattr(model, "on_loop", None)
    assert state.resolved is not None
    if on_loop is not None and on_loop(state.resolved.model):
        return generate_stream_on_loop(pipeline, state, parent, model, genai)
    return _Offloaded(generate_stream(pipeline, state, parent, genai), offload)


def _options(state: RequestState, hooks: CallHooks, parent: Any) -> CallOptions:
    # The tenant names the request's queue in the model's fair share (only the gateway sets it).
    return CallOptions(state.remaining(), (*hooks.metadata, tenant_metadata(state.tenant)), parent)


class _Reported:
    """A model stream that tells the hooks how it ended, once."""

    def __init__(self, stream: ChunkStream, hooks: CallHooks) -> None:
        self._stream = stream
        self._hooks = hooks

    def __iter__(self) -> Iterator[generation_pb2.GenerateChunk]:
        return self

    def __next__(self) -> generation_pb2.GenerateChunk:
        try:
            return next(self._stream)
        except StopIteration:
            self._hooks.end(grpc.StatusCode.OK)
            raise
        except grpc.RpcError as error:
            self._hooks.end(status_of(error))
            raise

    def cancel(self) -> bool:
        self._hooks.end(grpc.StatusCode.CANCELLED)
        return self._stream.cancel()

    def initial_metadata(self) -> Sequence[tuple[str, str]]:
        return self._stream.initial_metadata()

    def trailing_metadata(self) -> Sequence[tuple[str, str]]:
        return self._stream.trailing_metadata()


class _ReportedOnLoop:
    """`_Reported` for a stream read on the caller's event loop."""

    def __init__(self, stream: AsyncChunkStream, hooks: CallHooks) -> None:
        self._stream = stream
        self._hooks = hooks

    def __aiter__(self) -> AsyncIterator[generation_pb2.GenerateChunk]:
        return self

    async def __anext__(self) -> generation_pb2.GenerateChunk:
        try:
            return await anext(self._stream)
        except StopAsyncIteration:
            self._hooks.end(grpc.StatusCode.OK)
            raise
        except grpc.RpcError as error:
            self._hooks.end(status_of(error))
            raise

    async def cancel(self) -> bool:
        self._hooks.end(grpc.StatusCode.CANCELLED)
        return await self._stream.cancel()

    def initial_metadata(self) -> Sequence[tuple[str, str]]:
        return self._stream.initial_metadata()

    def trailing_metadata(self) -> Sequence[tuple[str, str]]:
        return self._stream.trailing_metadata()


_END = object()


def _next(stream: ChunkStream) -> Any:
    return next(stream, _END)


class _Offloaded:
    """A blocking `ChunkStream` read from an event loop, each chunk fetched by `offload`
    (a handler thread); `cancel` stops the model from the loop (a `ChunkStream`'s cancel is
    safe from any thread)."""

    def __init__(self, stream: ChunkStream, offload: Offload) -> None:
        self._stream = stream
        self._offload = offload

    def __aiter__(self) -> AsyncIterator[generation_pb2.GenerateChunk]:
        return self

    async def __anext__(self) -> generation_pb2.GenerateChunk:
        chunk = await self._offload(_next, self._stream)
        if chunk is _END:
            raise StopAsyncIteration
        return chunk  # type: ignore[no-any-return]

    async def cancel(self) -> bool:
        return self._stream.cancel()

    def initial_metadata(self) -> Sequence[tuple[str, str]]:
        return self._stream.initial_metadata()

    def trailing_metadata(self) -> Sequence[tuple[str, str]]:
        return self._stream.trailing_metadata()
