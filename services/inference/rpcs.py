"""One model server's three faces: its own operations, the `Inference` interface in this
process, and the gRPC rpcs.

A model server (`InferenceService`, one model; `ModelRouter`, every model of the process)
implements three operations on a `ModelCall` — what it reads of its caller's call — and
answers with values: `answer` (a whole answer and its trailing metadata), `chunks` (a
stream, its metadata set on a `StreamHeaders` as it learns it) and `describe`; a refusal is
a raised `LocalRpcError` carrying its code, message and trailing metadata. Everything else
here is a thin adapter over those, as each middleware's rpc is over its interface:

- `generate` / `generate_stream` / `models`: the `Inference` interface, for a caller in this
  process — the wire's deadline, cancel and UNKNOWN rules (`services.pipeline.local_call`),
  nothing acted out;
- `Generate` / `GenerateStream` / `Models`: the gRPC servicer, for the layered inference
  process — the servicer context *is* the `ModelCall`, and the values go onto it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Iterator
from contextlib import closing
from typing import Any, NoReturn, Protocol

from services.inference.api import Generated
from services.pipeline.interface import NO_OPTIONS, CallOptions
from services.pipeline.local_call import LocalStream, StreamHeaders, call_local, open_stream
from services.pipeline.local_context import LocalRpcError
from wire.v1 import generation_pb2, inference_pb2, inference_pb2_grpc


class ModelCall(Protocol):
    """What a model reads of the call that asked it: a gRPC servicer context is one (the
    layered inference process), a `LocalCall` another (the spine)."""

    def invocation_metadata(self) -> Any: ...

    def time_remaining(self) -> float | None: ...

    def is_active(self) -> bool: ...

    def add_callback(self, callback: Callable[[], None]) -> bool: ...


class InferenceRpcs(inference_pb2_grpc.InferenceServicer, ABC):
    """A model server: its three operations, and the adapters that serve them."""

    @abstractmethod
    def answer(self, request: generation_pb2.GenerateRequest, call: ModelCall) -> Generated:
        """The whole answer with its trailing metadata; a refusal raised as `LocalRpcError`."""

    @abstractmethod
    def chunks(self, request: generation_pb2.GenerateRequest, call: ModelCall,
               headers: StreamHeaders) -> Generator[generation_pb2.GenerateChunk, None, None]:
        """The answer chunk by chunk (closing it early stops the model's work); its metadata
        on `headers`; a refusal raised as `LocalRpcError`."""

    @abstractmethod
    def describe(self) -> tuple[inference_pb2.ModelInfoResponse, tuple[tuple[str, str], ...]]:
        """Every model served here, with the trailing metadata the answer goes out with."""

    # -- `services.inference.api.Inference`, for a caller in this process --------------
    def generate(self, request: generation_pb2.GenerateRequest, options: CallOptions = NO_OPTIONS) -> Generated:
        return call_local(lambda call: self.answer(request, call), options)

    def generate_stream(self, request: generation_pb2.GenerateRequest,
                        options: CallOptions = NO_OPTIONS) -> LocalStream[generation_pb2.GenerateChunk]:
        return open_stream(lambda call, headers: self.chunks(request, call, headers), options)

    def models(self, request: inference_pb2.ModelInfoRequest,
               options: CallOptions = NO_OPTIONS) -> inference_pb2.ModelInfoResponse:
        return call_local(lambda call: self.describe()[0], options)

    # -- gRPC: the servicer context is the call, the values go onto it ------------------
    def Generate(self, request: generation_pb2.GenerateRequest, context: Any) -> generation_pb2.GenerateResponse:
        try:
            answer = self.answer(request, context)
        except LocalRpcError as refused:
            _abort(context, refused)
        context.set_trailing_metadata(answer.trailing)
        return answer.response

    def GenerateStream(self, request: generation_pb2.GenerateRequest,
                       context: Any) -> Iterator[generation_pb2.GenerateChunk]:
        headers = StreamHeaders()
        initial_sent = False
        # closing(): the reader leaving closes this generator, and with it the model's (its slot is freed)
        with closing(self.chunks(request, context, headers)) as chunks:
            try:
                for chunk in chunks:
                    if not initial_sent and headers.initial:
                        context.send_initial_metadata(headers.initial)
                        initial_sent = True
                    yield chunk
            except LocalRpcError as refused:
                _abort(context, refused)
        context.set_trailing_metadata(headers.trailing)

    def Models(self, request: inference_pb2.ModelInfoRequest, context: Any) -> inference_pb2.ModelInfoResponse:
        described, trailing = self.describe()
        context.set_trailing_metadata(trailing)
        return described


def _abort(context: Any, refused: LocalRpcError) -> NoReturn:
    context.set_trailing_metadata(tuple(refused.trailing_metadata()))
    context.abort(refused.code(), refused.details())
    raise AssertionError("context.abort returned")  # abort always raises
