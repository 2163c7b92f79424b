"""The load generator's HTTP side: the same closed-loop workers and prompts as `bench.load`,
calling a layout's HTTP API (`POST /v1/completions`, OpenAI's shape) instead of its gRPC one.

One keep-alive connection per worker, as a client pool keeps them; over the layout's unix
socket (`--http-listen unix:...`), as its gRPC listener is, so an HTTP/gRPC ratio measures
the two protocols' paths and not TCP against a socket file. Standard library only: the
client's own cost per call is that of `http.client` and `json`, the same in every column.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from typing import Any

from bench.load import Call
from wire.v1 import generation_pb2


class UnixHTTPConnection(http.client.HTTPConnection):
    """`http.client` over a unix socket (`path`)."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.path)
        self.sock = sock


def connection(address: str, timeout: float) -> http.client.HTTPConnection:
    if address.startswith("unix:"):
        return UnixHTTPConnection(address[len("unix:"):], timeout)
    host, _, port = address.rpartition(":")
    return http.client.HTTPConnection(host.strip("[]"), int(port), timeout=timeout)


class HttpEndpoint:
    """`bench.load.Endpoint`'s interface over HTTP: a connection per worker, timed calls."""

    gateway = True

    def __init__(self, address: str, token: str, timeout_s: float = 30.0) -> None:
        self.address = address
        self.headers = {"content-type": "application/json", "authorization": f"Bearer {token}"}
        self.timeout_s = timeout_s
        self._connections: list[http.client.HTTPConnection] = []

    def stubs(self, count: int) -> list[Any]:
        while len(self._connections) < count:
            self._connections.append(connection(self.address, self.timeout_s))
        return self._connections[:count]

    def call(self, stub: Any, request: generation_pb2.GenerateRequest, stream: bool, timeout_s: float) -> Call:
        body = json.dumps({"model": request.model, "prompt": request.prompt, "max_tokens": request.max_tokens,
                           "temperature": request.temperature, "stream": stream}).encode()
        started = time.perf_counter()
        try:
            answer = self._send(stub, body)
            if not stream or answer.status != 200:
                answer.read()
                latency = time.perf_counter() - started
                return Call(answer.status == 200, latency, "OK" if answer.status == 200 else f"HTTP {answer.status}")
            arrivals: list[float] = []
            for line in answer:
                if line.startswith(b"data: {") and b'"text":""' not in line:
                    arrivals.append(time.perf_counter())
        except (OSError, http.client.HTTPException) as error:
            stub.close()  # reconnects on the next call
            return Call(False, time.perf_counter() - started, type(error).__name__)
        latency = time.perf_counter() - started
        gaps = [later - earlier for earlier, later in zip(arrivals, arrivals[1:], strict=False)]
        return Call(True, latency, ttft_s=arrivals[0] - started if arrivals else None, itl_s=gaps)

    def _send(self, stub: http.client.HTTPConnection, body: bytes) -> http.client.HTTPResponse:
        """The request's response; once more on a new connection when a kept-alive one was
        closed by the server while idle (its keep-alive timeout between cells), as a client
        pool does: that is the pool's housekeeping, not the server failing a request."""
        reused = stub.sock is not None
        try:
            stub.request("POST", "/v1/completions", body=body, headers=self.headers)
            return stub.getresponse()
        except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
            if not reused:
                raise
            stub.close()
            stub.request("POST", "/v1/completions", body=body, headers=self.headers)
            return stub.getresponse()

    def close(self) -> None:
        for conn in self._connections:
            conn.close()
        self._connections.clear()
