"""The load generator: N closed-loop workers, each with its own channel, timing every call.

The same code drives all layouts; only the stub (Gateway or bare Inference) and the
credential differ, so the client's own overhead is the same in every column.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from spine.tools.workload.generator import WORDS, closed_loop
from wire.v1 import gateway_pb2_grpc, generation_pb2, inference_pb2_grpc


def prompts(tag: str, count: int, start: int = 0) -> list[str]:
    """Distinct prompts of equal length, so no response-cache hit and the same work per call."""
    out = []
    for index in range(start, start + count):
        words = " ".join(WORDS[(index * 7 + k * 3) % len(WORDS)] for k in range(4))
        out.append(f"{tag} {index:05d} {words}")
    return out


def requests_for(texts: Sequence[str], max_tokens: int, model: str = "tiny-lm") -> list[generation_pb2.GenerateRequest]:
    """Greedy requests (temperature 0): deterministic work, comparable across layouts."""
    return [generation_pb2.GenerateRequest(model=model, prompt=text, max_tokens=max_tokens, temperature=0.0)
            for text in texts]


@dataclass
class Call:
    """One timed call. Stream calls also keep when each token-bearing chunk arrived."""

    ok: bool
    latency_s: float
    code: str = "OK"
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)


@dataclass
class Batch:
    """What one burst of calls against one target produced."""

    calls: list[Call]
    wall_s: float
    unsent: int


class Endpoint:
    """How to call one target: a stub per worker (own channel, own connection) and metadata."""

    def __init__(self, address: str, gateway: bool, token: str | None) -> None:
        self.address = address
        self.gateway = gateway
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if gateway and token else ()
        self._channels: list[grpc.Channel] = []
        self._stubs: list[Any] = []

    def stubs(self, count: int) -> list[Any]:
        """At least `count` connected stubs (channels are made once and reused across runs)."""
        while len(self._stubs) < count:
            channel = grpc.insecure_channel(self.address, options=[
                ("grpc.use_local_subchannel_pool", 1),  # a connection per worker, like separate clients
                ("grpc.enable_retries", 0),
            ])
            grpc.channel_ready_future(channel).result(timeout=30)
            self._channels.append(channel)
            stub_class = gateway_pb2_grpc.GatewayStub if self.gateway else inference_pb2_grpc.InferenceStub
            self._stubs.append(stub_class(channel))
        return self._stubs[:count]

    def call(self, stub: Any, request: generation_pb2.GenerateRequest, stream: bool, timeout_s: float) -> Call:
        started = time.perf_counter()
        if not stream:
            try:
                stub.Generate(request, timeout=timeout_s, metadata=self.metadata)
            except grpc.RpcError as error:
                return Call(False, time.perf_counter() - started, error.code().name)
            return Call(True, time.perf_counter() - started)
        arrivals: list[float] = []
        try:
            for chunk in stub.GenerateStream(request, timeout=timeout_s, metadata=self.metadata):
                if chunk.token_ids:
                    arrivals.append(time.perf_counter())
        except grpc.RpcError as error:
            return Call(False, time.perf_counter() - started, error.code().name)
        latency = time.perf_counter() - started
        ttft = arrivals[0] - started if arrivals else None
        gaps = [later - earlier for earlier, later in zip(arrivals, arrivals[1:], strict=False)]
        return Call(True, latency, ttft_s=ttft, itl_s=gaps)

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
        self._channels.clear()
        self._stubs.clear()


class Caller(Protocol):
    """What `run_batch` drives: `Endpoint` (gRPC) or `bench.http_load.HttpEndpoint` (HTTP)."""

    def stubs(self, count: int) -> list[Any]: ...

    def call(self, stub: Any, request: generation_pb2.GenerateRequest, stream: bool, timeout_s: float) -> Call: ...


def run_batch(endpoint: Caller, requests: Sequence[generation_pb2.GenerateRequest], *, concurrency: int,
              stream: bool = False, time_limit_s: float = 20.0, call_timeout_s: float = 30.0) -> Batch:
    """Send `requests` with `concurrency` closed-loop workers; stop starting new ones at the time limit."""
    calls: list[Call] = []
    lock = threading.Lock()
    started = time.perf_counter()

    def send(stub: Any, index: int) -> None:
        call = endpoint.call(stub, requests[index], stream, call_timeout_s)
        with lock:
            calls.append(call)

    closed_loop(len(requests), endpoint.stubs(concurrency), send, time_limit_s)
    wall = time.perf_counter() - started
    return Batch(calls, wall, max(0, len(requests) - len(calls)))
