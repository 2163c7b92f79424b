"""The model component as its callers see it, wherever it runs: `Inference`, and how each of
its operations crosses the wire (`Generate`, `GenerateStream`, `Models`).

Apart from the servicer (its engine and torch): a gateway whose model runs in another process
imports this and not torch.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from services.pipeline.interface import (
    NO_OPTIONS,
    CallOptions,
    Interface,
    Metadata,
    StreamRpc,
    UnaryRpc,
    message,
)
from wire.v1 import generation_pb2, inference_pb2


@dataclass(frozen=True, slots=True)
class Generated:
    """A whole answer and the trailing metadata it came with (its model's load hint)."""

    response: generation_pb2.GenerateResponse
    trailing: tuple[tuple[str, str], ...] = ()


class ChunkStream(Protocol):
    """An answer streamed chunk by chunk: a `grpc.RpcError` ends it early; `cancel` stops the
    model now, from any thread."""

    def __iter__(self) -> Iterator[generation_pb2.GenerateChunk]: ...

    def __next__(self) -> generation_pb2.GenerateChunk: ...

    def cancel(self) -> bool: ...

    def initial_metadata(self) -> Sequence[tuple[str, str]]: ...

    def trailing_metadata(self) -> Sequence[tuple[str, str]]: ...


class AsyncChunkStream(Protocol):
    """`ChunkStream` read on the caller's event loop: `cancel` is awaited there."""

    def __aiter__(self) -> AsyncIterator[generation_pb2.GenerateChunk]: ...

    async def __anext__(self) -> generation_pb2.GenerateChunk: ...

    async def cancel(self) -> bool: ...

    def initial_metadata(self) -> Sequence[tuple[str, str]]: ...

    def trailing_metadata(self) -> Sequence[tuple[str, str]]: ...


class Inference(Protocol):
    """Every model served by the inference component."""

    def generate(self, request: generation_pb2.GenerateRequest, options: CallOptions = NO_OPTIONS) -> Generated:
        """The whole answer to a routed request; its verdicts (INVALID_ARGUMENT, the compute
        budget's DEADLINE_EXCEEDED, a full queue's RESOURCE_EXHAUSTED) raised as `grpc.RpcError`."""
        ...

    def generate_stream(self, request: generation_pb2.GenerateRequest,
                        options: CallOptions = NO_OPTIONS) -> ChunkStream:
        """The answer chunk by chunk."""
        ...

    def models(self, request: inference_pb2.ModelInfoRequest,
               options: CallOptions = NO_OPTIONS) -> inference_pb2.ModelInfoResponse:
        """Every model served here, with its load hint now."""
        ...


class OnLoop(Protocol):
    """What an inference component in the caller's process may offer besides `Inference`: the
    answer of a model that never blocks a thread (an upstream engine's, network I/O),
    awaited on the caller's own event loop, so a request served on a loop stays there."""

    def on_loop(self, model: str) -> bool:
        """Whether `model`'s answer can be awaited on the caller's loop (`generate_on_loop`)."""
        ...

    async def generate_on_loop(self, request: generation_pb2.GenerateRequest,
                               options: CallOptions = NO_OPTIONS) -> Generated:
        """`Inference.generate`, awaited; the same verdicts, raised as `grpc.RpcError`."""
        ...

    def generate_stream_on_loop(self, request: generation_pb2.GenerateRequest,
                                options: CallOptions = NO_OPTIONS) -> AsyncChunkStream:
        """`Inference.generate_stream`, read on the caller's loop; the same verdicts."""
        ...


def _request(request: generation_pb2.GenerateRequest) -> generation_pb2.GenerateRequest:
    return request


def _generated(response: generation_pb2.GenerateResponse, trailing: Metadata) -> Generated:
    return Generated(response, tuple(trailing))


GENERATE: UnaryRpc[generation_pb2.GenerateRequest, Generated] = UnaryRpc("Generate", "generate", _request,
                                                                         _generated)
GENERATE_STREAM: StreamRpc[generation_pb2.GenerateRequest] = StreamRpc("GenerateStream", "generate_stream")
MODELS = message("Models", "models")

INFERENCE: Interface[Inference] = Interface("inference", [GENERATE, GENERATE_STREAM, MODELS])
