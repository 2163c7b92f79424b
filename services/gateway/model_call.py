"""The gateway's call of the model: through its interface, as placed now, under the hooks.

A request's model call is the one call the gateway makes outside a stage's batch (the
engine batches decode steps itself), so it runs the pipeline's hooks itself
(`Pipeline.begin_call`): the span and an injected fault are the same in every placement.
A stream reports how it ended to the hooks once: at its last chunk, its error, or its cancel.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from services.inference.api import INFERENCE, ChunkStream, Generated
from services.pipeline.interface import CallOptions
from services.pipeline.local_call import status_of
from services.pipeline.pipeline import CallHooks, Pipeline
from services.pipeline.state import RequestState
from wire.v1 import generation_pb2


def generate(pipeline: Pipeline, state: RequestState, parent: Any) -> Generated:
    """The whole answer to `state`'s routed request; a `grpc.RpcError` as the wire would."""
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


def generate_stream(pipeline: Pipeline, state: RequestState, parent: Any) -> ChunkStream:
    """The answer to `state`'s routed request, chunk by chunk."""
    hooks = pipeline.begin_call(pipeline.model, state)
    try:
        assert state.resolved is not None
        stream = pipeline.components.get(INFERENCE).generate_stream(state.resolved, _options(state, hooks, parent))
    except grpc.RpcError as error:
        hooks.end(status_of(error))
        raise
    return _Reported(stream, hooks)


def _options(state: RequestState, hooks: CallHooks, parent: Any) -> CallOptions:
    return CallOptions(state.remaining(), hooks.metadata, parent)


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
