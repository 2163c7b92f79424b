"""A component behaves alike in both placements: codes, deadlines, cancellation, metadata.

A small scripted model server (the prompt says what to do) stands behind the model's
interface both ways: the generic remote proxy to its gRPC adapter on a real server on a unix
socket (`runtime.placement.remote`), and the server called in this process
(`runtime.placement.in_process`).
"""

from __future__ import annotations

import importlib
import inspect
import threading
import time
from collections.abc import Generator, Iterator
from typing import Any

import grpc
import pytest

from runtime.placement.in_process import in_process
from runtime.placement.remote import remote, remote_channel
from runtime.server import start_server
from services.inference.api import INFERENCE, Generated
from services.inference.rpcs import InferenceRpcs, ModelCall
from services.pipeline.interface import CallOptions
from services.pipeline.local_call import StreamHeaders
from services.pipeline.local_context import LocalContext, LocalRpcError
from services.registry import DEFAULT
from tests.waiting import ManualClock, eventually
from wire.v1 import generation_pb2, inference_pb2


class ScriptedInference(InferenceRpcs):
    """Does what the prompt says, and records what it saw: a model server
    (`services.inference.rpcs`), so one script is served in process through its interface and
    remotely through its gRPC adapter."""

    def __init__(self) -> None:
        self.stopped = threading.Event()
        self.callback_ran = threading.Event()
        self.seen_metadata: dict[str, str] = {}

    def answer(self, request: generation_pb2.GenerateRequest, call: ModelCall) -> Generated:
        self.seen_metadata = dict(call.invocation_metadata())
        call.add_callback(self.callback_ran.set)
        if request.prompt == "abort":
            raise LocalRpcError(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens: must be > 0, got 0",
                                (("retry-after", "1.5"),))
        if request.prompt == "raise":
            raise ValueError("boom")
        if request.prompt == "slow":
            while call.is_active():
                time.sleep(0.005)
            self.stopped.set()
            return Generated(generation_pb2.GenerateResponse(text="too late"))
        return Generated(generation_pb2.GenerateResponse(text=request.prompt.upper(), token_ids=[1, 2, 3],
                                                         model=self.seen_metadata.get("x-test", "")),
                         (("x-spine-load", "scripted"),))

    def chunks(self, request: generation_pb2.GenerateRequest, call: ModelCall,
               headers: StreamHeaders) -> Generator[generation_pb2.GenerateChunk, None, None]:
        call.add_callback(self.callback_ran.set)
        headers.set_initial((("x-spine-upstream", "scripted"),))
        for index in range(request.max_tokens):
            if not call.is_active():
                self.stopped.set()
                return
            if request.prompt == "fail-midway" and index == 2:
                raise LocalRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "tokens per minute reached")
            yield generation_pb2.GenerateChunk(text=str(index), token_ids=[index], index=index)
            if request.prompt == "slow":
                time.sleep(0.02)
        headers.set_trailing((("x-spine-load", "scripted"),))
        self.stopped.set()

    def describe(self) -> tuple[inference_pb2.ModelInfoResponse, tuple[tuple[str, str], ...]]:
        return inference_pb2.ModelInfoResponse(models=[inference_pb2.ModelInfo(id="m")]), ()


@pytest.fixture(params=["local", "remote"])
def bound(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[tuple[Any, ScriptedInference]]:
    spec = DEFAULT["inference"]
    servicer = ScriptedInference()
    if request.param == "local":
        yield in_process(INFERENCE, servicer), servicer
        return
    server = start_server([(spec, servicer)], f"unix:{tmp_path}/inference.sock")
    channel = remote_channel(server.address, 1 << 20)
    try:
        yield remote(INFERENCE, spec.stub_class()(channel), channel), servicer
    finally:
        channel.close()
        server.stop(0)


def req(prompt: str, max_tokens: int = 3) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(model="m", prompt=prompt, max_tokens=max_tokens)


def test_ok_response_and_metadata_reach_the_servicer(bound: Any) -> None:
    model, servicer = bound
    reply = model.generate(req("hi"), CallOptions(5, (("x-test", "abc"),))).response
    assert (reply.text, list(reply.token_ids), reply.model) == ("HI", [1, 2, 3], "abc")
    assert servicer.seen_metadata["x-test"] == "abc"


def test_abort_gives_code_details_and_trailing_metadata(bound: Any) -> None:
    model, _ = bound
    with pytest.raises(grpc.RpcError) as caught:
        model.generate(req("abort"), CallOptions(5))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "max_tokens: must be > 0, got 0"
    assert ("retry-after", "1.5") in tuple(caught.value.trailing_metadata())


def test_exception_in_handler_is_unknown(bound: Any) -> None:
    model, _ = bound
    with pytest.raises(grpc.RpcError) as caught:
        model.generate(req("raise"), CallOptions(5))
    assert caught.value.code() == grpc.StatusCode.UNKNOWN
    assert "boom" in caught.value.details()


def test_an_answer_carries_its_metadata_both_ways(bound: Any) -> None:
    model, _ = bound
    assert ("x-spine-load", "scripted") in model.generate(req("hi"), CallOptions(5)).trailing
    stream = model.generate_stream(req("go", max_tokens=2), CallOptions(5))
    assert [chunk.index for chunk in stream] == [0, 1]
    assert ("x-spine-upstream", "scripted") in tuple(stream.initial_metadata())
    assert ("x-spine-load", "scripted") in tuple(stream.trailing_metadata())


def test_deadline_is_exceeded_and_the_servicer_sees_it(bound: Any) -> None:
    model, servicer = bound
    with pytest.raises(grpc.RpcError) as caught:
        model.generate(req("slow"), CallOptions(0.1))
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert servicer.stopped.wait(2.0), "the servicer never saw is_active() turn False"
    assert servicer.callback_ran.wait(2.0)


def test_parent_cancellation_stops_the_call(bound: Any) -> None:
    model, servicer = bound
    parent = LocalContext(deadline=time.monotonic() + 0.1)
    with pytest.raises(grpc.RpcError) as caught:
        model.generate(req("slow"), CallOptions(5, parent=parent))
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
    model, _ = bound
    chunks = list(model.generate_stream(req("go", max_tokens=5), CallOptions(5)))
    assert [c.index for c in chunks] == [0, 1, 2, 3, 4]


def test_stream_error_midway_keeps_the_chunks_sent(bound: Any) -> None:
    model, _ = bound
    got: list[int] = []
    with pytest.raises(grpc.RpcError) as caught:
        for chunk in model.generate_stream(req("fail-midway", max_tokens=5), CallOptions(5)):
            got.append(chunk.index)
    assert got == [0, 1]
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_stream_cancel_stops_the_servicer(bound: Any) -> None:
    model, servicer = bound
    stream = model.generate_stream(req("slow", max_tokens=200), CallOptions(10))
    next(stream)
    stream.cancel()
    assert servicer.callback_ran.wait(2.0)


def test_stream_deadline(bound: Any) -> None:
    model, _ = bound
    with pytest.raises(grpc.RpcError) as caught:
        for _ in model.generate_stream(req("slow", max_tokens=200), CallOptions(0.1)):
            pass
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_stream_hears_its_parent_end_while_nobody_reads_it(bound: Any) -> None:
    model, servicer = bound
    parent = LocalContext()
    stream = model.generate_stream(req("slow", max_tokens=200), CallOptions(10, parent=parent))
    next(stream)  # then nobody reads: only the parent's end can reach the servicer
    parent.cancel()
    assert servicer.callback_ran.wait(2.0), "the servicer's callbacks did not run on the parent's cancel"


def test_a_local_stream_can_be_cancelled_from_another_thread_while_it_is_being_read() -> None:
    servicer = ScriptedInference()
    stream = in_process(INFERENCE, servicer).generate_stream(req("slow", max_tokens=500), CallOptions(10))
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
    eventually(lambda: got, what="a first chunk read", interval=0.005)
    assert stream.cancel()  # the reader's thread may be inside the generator right now
    reader.join(5.0)
    assert not reader.is_alive()
    assert servicer.stopped.wait(2.0)
    assert len(got) < 500


def _implementations() -> list[tuple[str, type, type]]:
    """(component, its interface's Protocol, a class that says it implements it)."""
    from services.auth.envoy_authz import EnvoyAuthzClient
    from services.auth.service import AuthService
    from services.cache.service import CacheService
    from services.inference.service import InferenceService
    from services.logs.service import LogsService
    from services.metrics.service import MetricsService
    from services.ratelimit.envoy_ratelimit import EnvoyRlsClient
    from services.ratelimit.service import RateLimitService
    from services.router.service import RouterService

    servicers = {"auth": [AuthService, EnvoyAuthzClient], "ratelimit": [RateLimitService, EnvoyRlsClient],
                 "router": [RouterService], "cache": [CacheService], "metrics": [MetricsService],
                 "logs": [LogsService], "inference": [InferenceService]}
    assert set(servicers) == {spec.name for spec in DEFAULT if spec.interface is not None}
    rows = []
    for name, classes in servicers.items():
        api = importlib.import_module(f"services.{name}.api")
        (protocol,) = [value for value in vars(api).values()
                       if isinstance(value, type) and getattr(value, "_is_protocol", False)
                       and value.__module__ == api.__name__ and set(_operations(value)) == set(
                           DEFAULT[name].interface.methods)]  # type: ignore[union-attr]
        rows += [(name, protocol, cls) for cls in classes]
    return rows


def _operations(protocol: type) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(value) for name, value in vars(protocol).items()
            if callable(value) and not name.startswith("_")}


@pytest.mark.parametrize(("component", "protocol", "implementation"), _implementations(),
                         ids=lambda value: getattr(value, "__name__", value))
def test_every_implementation_has_its_interfaces_operations_as_declared(component: str, protocol: type,
                                                                        implementation: type) -> None:
    """The servicer, and a foreign protocol's client, each implement the component's whole
    interface (mypy holds the types where they are placed; this holds that nothing is missing)."""
    for name, signature in _operations(protocol).items():
        method = getattr(implementation, name, None)
        assert callable(method), f"{implementation.__name__} has no {name}"
        assert list(inspect.signature(method).parameters) == list(signature.parameters), name


@pytest.mark.parametrize("component", [spec.name for spec in DEFAULT if spec.interface is not None])
def test_the_generic_proxies_have_every_operation_of_an_interface(component: str) -> None:
    interface = DEFAULT[component].interface
    assert interface is not None
    for made in (remote(interface, object(), grpc.insecure_channel("unix:/nonexistent")),
                 in_process(interface, object())):
        assert sorted(name for name in interface.methods if callable(getattr(made, name, None))) == sorted(
            interface.methods)
