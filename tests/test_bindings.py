"""The local and remote bindings behave alike: codes, deadlines, cancellation, metadata, hooks.

A small scripted servicer (the prompt says what to do) stands behind both bindings: a
real gRPC server on a unix socket for the remote one, a direct call for the local one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from runtime.binding_classes import LocalInferenceBinding, RemoteInferenceBinding
from runtime.bindings import LocalContext
from runtime.remote_binding import remote_channel
from runtime.server import start_server
from services.registry import DEFAULT
from tests.waiting import ManualClock
from wire.v1 import generation_pb2, inference_pb2_grpc


class ScriptedInference(inference_pb2_grpc.InferenceServicer):
    """Does what the prompt says, and records what it saw."""

    def __init__(self) -> None:
        self.stopped = threading.Event()
        self.callback_ran = threading.Event()
        self.seen_metadata: dict[str, str] = {}

    def Generate(self, request: generation_pb2.GenerateRequest, context: Any) -> generation_pb2.GenerateResponse:
        self.seen_metadata = dict(context.invocation_metadata())
        context.add_callback(self.callback_ran.set)
        if request.prompt == "abort":
            context.set_trailing_metadata((("retry-after", "1.5"),))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens: must be > 0, got 0")
        if request.prompt == "raise":
            raise ValueError("boom")
        if request.prompt == "set_code":
            context.set_code(grpc.StatusCode.NOT_FOUND)
            context.set_details("no such model")
            return generation_pb2.GenerateResponse()
        if request.prompt == "slow":
            while context.is_active():
                time.sleep(0.005)
            self.stopped.set()
            return generation_pb2.GenerateResponse(text="too late")
        return generation_pb2.GenerateResponse(text=request.prompt.upper(), token_ids=[1, 2, 3],
                                               model=self.seen_metadata.get("x-test", ""))

    def GenerateStream(self, request: generation_pb2.GenerateRequest,
                       context: Any) -> Iterator[generation_pb2.GenerateChunk]:
        context.add_callback(self.callback_ran.set)
        for index in range(request.max_tokens):
            if not context.is_active():
                self.stopped.set()
                return
            if request.prompt == "fail-midway" and index == 2:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "tokens per minute reached")
            yield generation_pb2.GenerateChunk(text=str(index), token_ids=[index], index=index)
            if request.prompt == "slow":
                time.sleep(0.02)
        self.stopped.set()


class Recorder:
    """A binding hook that records (component, method, code)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []

    def begin(self, component: str, method: str, metadata: list[tuple[str, str]]) -> tuple[str, str]:
        metadata.append(("x-hooked", "yes"))
        return component, method

    def end(self, token: tuple[str, str], code: grpc.StatusCode) -> None:
        self.calls.append((*token, code.name))


@pytest.fixture(params=["local", "remote"])
def bound(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[tuple[Any, ScriptedInference, Recorder]]:
    spec = DEFAULT["inference"]
    servicer = ScriptedInference()
    recorder = Recorder()
    if request.param == "local":
        yield LocalInferenceBinding("inference", spec.descriptor(), servicer, [recorder]), servicer, recorder
        return
    server = start_server([(spec, servicer)], f"unix:{tmp_path}/inference.sock")
    binding = RemoteInferenceBinding("inference", spec.descriptor(), spec.stub_class(),
                            remote_channel(server.address, 1 << 20), [recorder])
    try:
        yield binding, servicer, recorder
    finally:
        binding.close()
        server.stop(0)


def req(prompt: str, max_tokens: int = 3) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(model="m", prompt=prompt, max_tokens=max_tokens)


def test_ok_response_and_metadata_reach_the_servicer(bound: Any) -> None:
    binding, servicer, _ = bound
    reply = binding.Generate(req("hi"), timeout=5, metadata=(("x-test", "abc"),))
    assert (reply.text, list(reply.token_ids), reply.model) == ("HI", [1, 2, 3], "abc")
    assert servicer.seen_metadata["x-hooked"] == "yes"


def test_abort_gives_code_details_and_trailing_metadata(bound: Any) -> None:
    binding, _, recorder = bound
    with pytest.raises(grpc.RpcError) as caught:
        binding.Generate(req("abort"), timeout=5)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "max_tokens: must be > 0, got 0"
    assert ("retry-after", "1.5") in tuple(caught.value.trailing_metadata())
    assert recorder.calls == [("inference", "Generate", "INVALID_ARGUMENT")]


def test_exception_in_handler_is_unknown(bound: Any) -> None:
    binding, _, _ = bound
    with pytest.raises(grpc.RpcError) as caught:
        binding.Generate(req("raise"), timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNKNOWN
    assert "boom" in caught.value.details()


def test_set_code_without_abort_ends_with_that_code(bound: Any) -> None:
    binding, _, _ = bound
    with pytest.raises(grpc.RpcError) as caught:
        binding.Generate(req("set_code"), timeout=5)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert caught.value.details() == "no such model"


def test_deadline_is_exceeded_and_the_servicer_sees_it(bound: Any) -> None:
    binding, servicer, _ = bound
    with pytest.raises(grpc.RpcError) as caught:
        binding.Generate(req("slow"), timeout=0.1)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert servicer.stopped.wait(2.0), "the servicer never saw is_active() turn False"
    assert servicer.callback_ran.wait(2.0)


def test_parent_cancellation_stops_the_call(bound: Any) -> None:
    binding, servicer, _ = bound
    parent = LocalContext(deadline=time.monotonic() + 0.1)
    with pytest.raises(grpc.RpcError) as caught:
        binding.Generate(req("slow"), timeout=5, parent=parent)
    parent.cancel()
    assert caught.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert servicer.stopped.wait(2.0)


def test_a_local_context_keeps_its_parents_deadline_and_end() -> None:
    """The parent's deadline is folded in at the start and its end arrives by callback
    (the context does not ask the parent on every check)."""
    clock = ManualClock()
    parent = LocalContext(deadline=clock() + 0.05, clock=clock)
    child = LocalContext(deadline=clock() + 10, parent=parent, clock=clock)
    assert child.time_remaining() == pytest.approx(0.05)
    clock.advance(0.04)
    assert child.is_active()
    clock.advance(0.02)
    assert not child.is_active()
    with pytest.raises(grpc.RpcError) as caught:
        child.check_live()
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    open_parent = LocalContext()
    child = LocalContext(parent=open_parent)
    assert child.time_remaining() is None and child.is_active()
    open_parent.cancel()
    assert not child.is_active()
    with pytest.raises(grpc.RpcError) as caught:
        child.check_live()
    assert caught.value.code() == grpc.StatusCode.CANCELLED

    late = LocalContext(parent=open_parent)  # the caller's RPC had already ended
    assert not late.is_active()


class _NoDeadlineParent:
    """What a gRPC server context without a deadline reports: a time far in the future."""

    def time_remaining(self) -> float:
        return 1.0e12

    def add_callback(self, callback: Any) -> bool:
        return True


def test_a_parent_without_a_deadline_leaves_the_childs_own() -> None:
    assert LocalContext(parent=_NoDeadlineParent()).time_remaining() is None
    remaining = LocalContext(deadline=time.monotonic() + 2, parent=_NoDeadlineParent()).time_remaining()
    assert remaining is not None and 1 < remaining <= 2


def test_stream_yields_every_chunk_in_order(bound: Any) -> None:
    binding, _, recorder = bound
    chunks = list(binding.GenerateStream(req("go", max_tokens=5), timeout=5))
    assert [c.index for c in chunks] == [0, 1, 2, 3, 4]
    assert recorder.calls == [("inference", "GenerateStream", "OK")]


def test_stream_error_midway_keeps_the_chunks_sent(bound: Any) -> None:
    binding, _, _ = bound
    got: list[int] = []
    with pytest.raises(grpc.RpcError) as caught:
        for chunk in binding.GenerateStream(req("fail-midway", max_tokens=5), timeout=5):
            got.append(chunk.index)
    assert got == [0, 1]
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_stream_cancel_stops_the_servicer(bound: Any) -> None:
    binding, servicer, recorder = bound
    stream = binding.GenerateStream(req("slow", max_tokens=200), timeout=10)
    next(stream)
    stream.cancel()
    assert servicer.callback_ran.wait(2.0)
    assert recorder.calls[-1] == ("inference", "GenerateStream", "CANCELLED")


def test_stream_deadline(bound: Any) -> None:
    binding, _, _ = bound
    with pytest.raises(grpc.RpcError) as caught:
        for _ in binding.GenerateStream(req("slow", max_tokens=200), timeout=0.1):
            pass
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_stream_hears_its_parent_end_while_nobody_reads_it(bound: Any) -> None:
    binding, servicer, _ = bound
    parent = LocalContext()
    stream = binding.GenerateStream(req("slow", max_tokens=200), timeout=10, parent=parent)
    next(stream)  # then nobody reads: only the parent's end can reach the servicer
    parent.cancel()
    assert servicer.callback_ran.wait(2.0), "the servicer's callbacks did not run on the parent's cancel"


def test_a_local_stream_can_be_cancelled_from_another_thread_while_it_is_being_read() -> None:
    servicer = ScriptedInference()
    binding = LocalInferenceBinding("inference", DEFAULT["inference"].descriptor(), servicer)
    stream = binding.GenerateStream(req("slow", max_tokens=500), timeout=10)
    got: list[int] = []
    outcome: list[BaseException] = []

    def read() -> None:
        try:
            for chunk in stream:
                got.append(chunk.index)
        except grpc.RpcError as error:
            outcome.append(error)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while not got:
        time.sleep(0.005)
    assert stream.cancel()  # the reader's thread may be inside the generator right now
    reader.join(5.0)
    assert not reader.is_alive()
    assert servicer.stopped.wait(2.0)
    assert len(got) < 500
