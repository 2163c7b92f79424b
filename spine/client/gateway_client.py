"""A small client for the Gateway API: one call, its answer, status, trailers and latency."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from services.inference.load_hints import LOAD_HEADER, parse_load
from wire.v1 import gateway_pb2_grpc, generation_pb2

_TIMING = re.compile(r"\d+(\.\d+)?s\b")


@dataclass
class CallResult:
    code: grpc.StatusCode
    details: str
    latency_s: float
    response: generation_pb2.GenerateResponse | None = None
    chunks: list[generation_pb2.GenerateChunk] = field(default_factory=list)
    trailing: dict[str, str] = field(default_factory=dict)
    first_chunk_s: float | None = None
    attempts: int = 1  # calls made for this answer (the load-aware helper retries on overload)
    model: str = ""  # the model or alias the answering call asked for (a fallback may differ)

    @property
    def load(self) -> dict[str, float]:
        """The server's load hints (`x-spine-load`): queue, running, slots, kv_free, ..."""
        return parse_load(self.trailing.get(LOAD_HEADER))

    @property
    def ok(self) -> bool:
        return self.code == grpc.StatusCode.OK

    @property
    def token_ids(self) -> list[int]:
        if self.response is not None:
            return list(self.response.token_ids)
        return [t for chunk in self.chunks for t in chunk.token_ids]

    @property
    def text(self) -> str:
        if self.response is not None:
            return self.response.text
        return "".join(chunk.text for chunk in self.chunks)

    @property
    def layout(self) -> str:
        return self.trailing.get("x-spine-layout", "")

    def decision(self) -> tuple[Any, ...]:
        """What parity compares: status, cache hit and tokens (latency aside)."""
        cached = self.response.cached if self.response is not None else any(c.cached for c in self.chunks)
        details = _TIMING.sub("<t>", self.details) if not self.ok else ""  # retry-after varies by ms
        return (self.code.name, details, cached, tuple(self.token_ids))


class GatewayClient:
    """Calls one Gateway address; reuses its channel. With `credentials` (e.g.
    `grpc.ssl_channel_credentials`) the channel speaks TLS, else plaintext."""

    def __init__(self, address: str, token: str | None = None, max_message_bytes: int = 4 << 20,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self.address = address
        self.token = token
        options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
        ]
        self.channel = (grpc.secure_channel(address, credentials, options=options) if credentials is not None
                        else grpc.insecure_channel(address, options=options))
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)

    def metadata(self, token: str | None = None, extra: dict[str, str] | None = None) -> list[tuple[str, str]]:
        md: list[tuple[str, str]] = []
        credential = token if token is not None else self.token
        if credential:
            md.append(("authorization", f"Bearer {credential}"))
        md.extend((extra or {}).items())
        return md

    def generate(self, request: generation_pb2.GenerateRequest, *, token: str | None = None,
                 timeout: float = 30.0, headers: dict[str, str] | None = None) -> CallResult:
        started = time.perf_counter()
        try:
            response, call = self.stub.Generate.with_call(request, timeout=timeout,
                                                           metadata=self.metadata(token, headers))
            return CallResult(grpc.StatusCode.OK, "", time.perf_counter() - started, response=response,
                              trailing=dict(call.trailing_metadata() or ()))
        except grpc.RpcError as rpc_error:
            error: Any = rpc_error  # also a grpc.Call
            return CallResult(error.code(), error.details() or "", time.perf_counter() - started,
                              trailing=dict(error.trailing_metadata() or ()))

    def stream(self, request: generation_pb2.GenerateRequest, *, token: str | None = None,
               timeout: float = 30.0, headers: dict[str, str] | None = None) -> CallResult:
        started = time.perf_counter()
        call = self.stub.GenerateStream(request, timeout=timeout, metadata=self.metadata(token, headers))
        result = CallResult(grpc.StatusCode.OK, "", 0.0)
        try:
            for chunk in call:
                if result.first_chunk_s is None:
                    result.first_chunk_s = time.perf_counter() - started
                result.chunks.append(chunk)
        except grpc.RpcError as error:
            result.code, result.details = error.code(), error.details() or ""
        result.latency_s = time.perf_counter() - started
        result.trailing = dict(call.trailing_metadata() or ())
        return result

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> GatewayClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
