"""The built-in front's window: what the gates read when the front carries the traffic."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc

from migration.traffic.front import SIDES, Front, Outcome
from runtime.server import start_server
from services.registry import GATEWAY
from tests.waiting import eventually
from wire.v1 import gateway_pb2_grpc, generation_pb2


def test_the_front_times_only_requests_answered_ok() -> None:
    front = Front({"layered": "127.0.0.1:1", "spine": "127.0.0.1:1"})  # never dialled
    try:
        now = time.time()
        front.outcomes.extend([Outcome(now, "spine", False, 1.0, ok=True)] * 90)
        front.outcomes.extend([Outcome(now, "spine", True, 2000.0)] * 5)    # failed by the layout, slowly
        front.outcomes.extend([Outcome(now, "spine", False, 0.05)] * 5)     # refused (e.g. UNAUTHENTICATED)
        spine = front.window(now - 1)["spine"]
    finally:
        front.close()
    assert (spine.requests, spine.errors, spine.ok_requests) == (100, 5, 90)
    assert spine.p99_ms == 1.0


def test_the_window_compares_model_answers_like_for_like() -> None:
    front = Front({"layered": "127.0.0.1:1", "spine": "127.0.0.1:1"})  # never dialled
    try:
        now = time.time()
        front.outcomes.extend(Outcome(now, "spine", False, float(ms), ok=True, model=True, in_flight=ms % 3 + 1)
                              for ms in range(10, 110))                                  # 10..109 ms by the model
        front.outcomes.extend([Outcome(now, "spine", False, 0.5, ok=True, in_flight=4)] * 100)  # cache hits
        front.outcomes.extend([Outcome(now, "spine", True, 900.0, in_flight=4)] * 2)           # failed
        front.outcomes.append(Outcome(now - 10, "spine", False, 5000.0, ok=True, model=True, in_flight=9))  # before
        window = front.window(now - 1)
    finally:
        front.close()
    spine, layered = window["spine"], window["layered"]
    # What the gates read is unchanged: every OK request, cache hits included.
    assert (spine.requests, spine.errors, spine.ok_requests) == (202, 2, 200)
    assert spine.p99_ms < 110
    assert spine.model_requests == 100
    assert spine.p50_model_ms == 59.5 and 108 < spine.p99_model_ms < 109
    assert spine.mean_in_flight == sum(ms % 3 + 1 for ms in range(10, 110)) / 100
    assert (layered.model_requests, layered.p50_model_ms, layered.p99_model_ms, layered.mean_in_flight) == (0, 0, 0, 0)


class HeldGateway(gateway_pb2_grpc.GatewayServicer):
    """Answers once `release` is set; prompt "hit" is a cache hit, "fail" fails UNAVAILABLE."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def Generate(self, request: generation_pb2.GenerateRequest, context: Any) -> generation_pb2.GenerateResponse:
        self.release.wait(10)
        if request.prompt == "fail":
            context.abort(grpc.StatusCode.UNAVAILABLE, "down")
        return generation_pb2.GenerateResponse(text="ok", token_ids=[1], cached=request.prompt == "hit")

    def GenerateStream(self, request: generation_pb2.GenerateRequest, context: Any) -> Iterator[Any]:
        response = self.Generate(request, context)
        yield generation_pb2.GenerateChunk(text="o", token_ids=[1], cached=response.cached)
        yield generation_pb2.GenerateChunk(text="k", token_ids=[2])


def test_the_front_notes_model_answers_and_the_concurrency_each_request_met() -> None:
    gateways = {side: HeldGateway() for side in SIDES}
    servers = {side: start_server([(GATEWAY, gateway)], "127.0.0.1:0") for side, gateway in gateways.items()}
    front = Front({side: server.address for side, server in servers.items()})
    front_server = start_server([(GATEWAY, front)], "127.0.0.1:0")
    channel = grpc.insecure_channel(front_server.address)
    stub = gateway_pb2_grpc.GatewayStub(channel)

    def call(side: str, prompt: str, stream: bool = False) -> None:
        request = generation_pb2.GenerateRequest(prompt=prompt, max_tokens=2)
        metadata = (("x-spine-route", side),)
        try:
            if stream:
                list(stub.GenerateStream(request, metadata=metadata, timeout=10))
            else:
                stub.Generate(request, metadata=metadata, timeout=10)
        except grpc.RpcError:
            pass

    started = time.time()
    try:
        spine_calls = [("model", False), ("model", True), ("hit", False), ("hit", True), ("fail", False)]
        threads = [threading.Thread(target=call, args=("spine", prompt, stream)) for prompt, stream in spine_calls]
        threads.append(threading.Thread(target=call, args=("layered", "model")))
        for thread in threads:
            thread.start()
        eventually(lambda: front.log.in_flight() == {"layered": 1, "spine": 5}, 10, "every call in flight",
                   seen=front.log.in_flight)
        for gateway in gateways.values():
            gateway.release.set()
        for thread in threads:
            thread.join(10)
        window = front.window(started)
        in_flight = front.log.in_flight()
    finally:
        channel.close()
        front_server.stop(0.2)
        front.close()
        for server in servers.values():
            server.stop(0.2)
    spine, layered = window["spine"], window["layered"]
    assert in_flight == {"layered": 0, "spine": 0}  # every request left, the failed one too
    assert (spine.requests, spine.errors, spine.ok_requests, spine.model_requests) == (5, 1, 4, 2)
    assert 1 <= spine.mean_in_flight <= 5 and spine.p50_model_ms > 0
    assert (layered.requests, layered.model_requests, layered.mean_in_flight) == (1, 1, 1.0)
    assert spine.requests == sum(1 for o in front.outcomes if o.side == "spine")
    assert sorted(o.in_flight for o in front.outcomes if o.side == "spine") == [1, 2, 3, 4, 5]
