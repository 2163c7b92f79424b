"""What an unauthenticated HTTP client can make the server hold: a request head past its
limits is answered 431 (414 for the request line) without buffering the rest, a chunked
body past its limit 413 as it passes it, and a flood of connections that stream header
lines keeps the server's memory bounded while a normal client is served."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import httpx
import psutil
import pytest
import yaml

from runtime.processes.launch import launch, spine_up_argv
from runtime.running_stack import RunningStack
from tests.conftest import DEV_KEY
from tests.http_helpers import HTTP_LIMITS, connect, raw
from tests.waiting import eventually
from wire.v1 import gateway_pb2_grpc, generation_pb2

AUTH = {"authorization": f"Bearer {DEV_KEY}"}
GOOD = {"model": "tiny-lm", "max_tokens": 2, "messages": [{"role": "user", "content": "fine"}]}
# The default config's key and model, for `spine up` without the tests' overrides.
DEFAULT_AUTH = {"authorization": "Bearer spine-dev-key-0000"}
DEFAULT_GOOD = {**GOOD, "model": "default"}


def still_serving(stack: RunningStack) -> None:
    with raw(stack) as client:
        answer = client.post("/v1/chat/completions", headers=AUTH, json=GOOD)
    assert answer.status_code == 200, answer.text


def serves(stack: RunningStack) -> bool:
    """Whether a request is served now (`still_serving`, asked again while it is not)."""
    try:
        still_serving(stack)
    except AssertionError:
        return False
    return True


def answer_to(stack: RunningStack, head: bytes, send_timeout_s: float = 5.0) -> bytes:
    """What the server answers a raw request head (b"" when it only closed the connection)."""
    with connect(stack) as sock:
        sock.settimeout(send_timeout_s)
        with contextlib.suppress(OSError):  # the server may stop reading once it refused
            sock.sendall(head)
        received = b""
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                received += chunk
    return received


@pytest.mark.parametrize("layout", ["collapsed", "layered"])
def test_too_many_fields_or_too_many_bytes_of_headers_get_431_in_the_api_shape(
        http_stacks: dict[str, RunningStack], layout: str) -> None:
    stack = http_stacks[layout]
    many = {f"x-field-{i}": "v" for i in range(200)}
    with raw(stack) as client:
        answer = client.post("/v1/chat/completions", headers={**AUTH, **many}, json=GOOD)
        assert answer.status_code == 431, answer.text
        assert "more than 100 header fields" in answer.json()["error"]["message"]
        assert answer.headers["x-spine-layout"] == layout and answer.headers["x-request-id"]
        anthropic = client.post("/v1/messages", headers={**AUTH, **many}, json=GOOD)
        assert anthropic.status_code == 431 and anthropic.json()["type"] == "error"
        long_line = client.post("/v1/chat/completions", headers={**AUTH, "x-long": "a" * 10_000}, json=GOOD)
        assert long_line.status_code == 431 and "a line" in long_line.json()["error"]["message"]
        fields_under = {f"x-field-{i}": "v" for i in range(90)}  # under every limit: served
        assert client.post("/v1/chat/completions", headers={**AUTH, **fields_under}, json=GOOD).status_code == 200
    # A megabyte of headers in lines under the line limit: refused once 64 KiB have come.
    lines = b"".join(b"x-pad-%d: %s\r\n" % (i, b"b" * 4000) for i in range(256))
    refused = answer_to(stack, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + lines + b"\r\n")
    assert refused.startswith(b"HTTP/1.1 431 ") and b"http.max_header_bytes" in refused, refused[:300]
    still_serving(stack)


def test_a_refused_head_behind_a_pipelined_request_waits_for_its_answer(http_stacks: dict[str, RunningStack]) -> None:
    stack = http_stacks["collapsed"]
    body = json.dumps(GOOD).encode()
    def request(extra: bytes = b"") -> bytes:
        return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                b"authorization: Bearer " + DEV_KEY.encode() + b"\r\n" + extra +
                b"content-length: %d\r\n\r\n" % len(body) + body)
    answers = answer_to(stack, request() + request(b"".join(b"x-%d: v\r\n" % i for i in range(200))))
    assert answers.startswith(b"HTTP/1.1 200 "), answers[:200]
    assert b"\r\nHTTP/1.1 431 " in answers or b"}HTTP/1.1 431 " in answers, answers[-400:]


def test_a_request_line_past_the_line_limit_gets_414(http_stacks: dict[str, RunningStack]) -> None:
    stack = http_stacks["collapsed"]
    answer = answer_to(stack, b"GET /v1/models?" + b"q" * 2_000_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 414 "), answer[:200]
    still_serving(stack)


def test_smuggling_shapes_are_still_refused(http_stacks: dict[str, RunningStack]) -> None:
    stack = http_stacks["collapsed"]
    for framing in (b"content-length: 5\r\ntransfer-encoding: chunked\r\n",
                    b"content-length: 5\r\ncontent-length: 6\r\n",
                    b"transfer-encoding: xchunked\r\n"):
        answer = answer_to(stack, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + framing + b"\r\nhello")
        assert answer.startswith(b"HTTP/1.1 400 "), (framing, answer[:200])
    still_serving(stack)


def test_a_chunked_body_past_the_limit_is_refused_as_it_passes_it(http_stacks: dict[str, RunningStack]) -> None:
    stack = http_stacks["collapsed"]
    limit = HTTP_LIMITS["max_body_bytes"]
    with connect(stack) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                     b"authorization: Bearer " + DEV_KEY.encode() + b"\r\ntransfer-encoding: chunked\r\n\r\n")
        piece = b"%x\r\n%s\r\n" % (1024, b" " * 1024)
        for _ in range(limit // 1024 + 2):  # just past the limit, and the body goes on
            sock.sendall(piece)
        sock.settimeout(5)
        head = sock.recv(4096)  # answered before the body ends (it never does)
    assert head.startswith(b"HTTP/1.1 413 "), head[:200]
    assert b"over the limit" in head
    still_serving(stack)


# -- memory under a flood -------------------------------------------------------------------
FLOODERS = 32
FLOOD_BYTES = 64 << 20  # what each flooding connection tries to send as header lines
DRIBBLERS = 16


@dataclass
class Served:
    """`spine up` in a process of its own (its memory is what is measured), default limits."""

    pid: int
    http_address: str
    address: str  # gRPC


@pytest.fixture(scope="module")
def spine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    workdir = tmp_path_factory.mktemp("flood")
    config = workdir / "spine.yaml"
    config.write_text(yaml.safe_dump({"http": {"max_connections": 256}}))  # room for the flood
    launched = launch("spine up", spine_up_argv(config, "collapsed", listen="127.0.0.1:0", http_listen="127.0.0.1:0",
                                                run_dir=workdir / "run"), log_path=workdir / "spine.log")
    try:
        ready = launched.wait_ready(120)
        yield Served(launched.pid, str(ready["http_address"]), str(ready["address"]))
    finally:
        launched.stop()


def flood(address: str, sent: list[int]) -> None:
    """Header lines, 8 KiB at a time from one buffer, until 64 MB or the server closes."""
    line = b"x-flood: " + b"f" * 8000 + b"\r\n"
    total = 0
    try:
        with open_socket(address) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            while total < FLOOD_BYTES:
                sock.sendall(line)
                total += len(line)
    except OSError:
        pass  # the server refused the head and closed the connection
    finally:
        sent.append(total)


def dribble(address: str, stop: threading.Event) -> None:
    """Header bytes one at a time, never ending the head (slowloris)."""
    with contextlib.suppress(OSError), open_socket(address) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-slow: ")
        while not stop.wait(0.05):
            sock.sendall(b"s")


def open_socket(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10.0)


def test_a_flood_of_header_lines_keeps_memory_bounded_while_others_are_served(spine: Served) -> None:
    server = psutil.Process(spine.pid)
    with httpx.Client(base_url=f"http://{spine.http_address}", timeout=30) as client:
        assert client.post("/v1/chat/completions", headers=DEFAULT_AUTH, json=DEFAULT_GOOD).status_code == 200
        baseline = peak = server.memory_info().rss
        stop = threading.Event()
        sent: list[int] = []
        floods = [threading.Thread(target=flood, args=(spine.http_address, sent)) for _ in range(FLOODERS)]
        dribbles = [threading.Thread(target=dribble, args=(spine.http_address, stop)) for _ in range(DRIBBLERS)]
        for thread in (*dribbles, *floods):
            thread.start()
        served = []
        while any(thread.is_alive() for thread in floods):
            peak = max(peak, server.memory_info().rss)
            if len(served) < 3:
                served.append(client.post("/v1/chat/completions", headers=DEFAULT_AUTH, json=DEFAULT_GOOD).status_code)
            time.sleep(0.01)
        stop.set()
        for thread in dribbles:
            thread.join(10)
        assert client.post("/v1/chat/completions", headers=DEFAULT_AUTH, json=DEFAULT_GOOD).status_code == 200
    grown = (peak - baseline) / 2**20
    assert set(served) == {200}, served
    assert grown < 100, f"the server grew by {grown:.0f} MiB under {FLOODERS} header floods"
    assert max(sent) < FLOOD_BYTES, "the server read a whole 64 MB head"


def test_the_grpc_listener_refuses_huge_metadata_and_messages_with_a_clear_status(spine: Served) -> None:
    """gRPC's own limits (runtime.server: `grpc.max_metadata_size`, `limits.max_message_bytes`)."""
    metadata = [("authorization", DEFAULT_AUTH["authorization"])]
    small = generation_pb2.GenerateRequest(model="default", prompt="hi", max_tokens=1)
    with grpc.insecure_channel(spine.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        assert stub.Generate(small, metadata=metadata, timeout=30).text is not None
        for request, extra, words in (
                (small, [("x-big", "a" * (1 << 20))], "metadata size exceeds"),
                (small, [(f"x-field-{i}", "v" * 100) for i in range(200)], "metadata size exceeds"),
                (generation_pb2.GenerateRequest(model="default", prompt="a" * (2 << 20), max_tokens=1), [],
                 "larger than max")):
            with pytest.raises(grpc.RpcError) as refused:
                stub.Generate(request, metadata=[*metadata, *extra], timeout=30)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert words in (refused.value.details() or "")
        assert stub.Generate(small, metadata=metadata, timeout=30).text is not None


def test_the_connections_within_the_cap_are_served_while_a_burst_past_it_is_refused(
        http_stacks: dict[str, RunningStack]) -> None:
    """The cap refuses only what is past it: every connection it admitted is served, however
    many refused ones are still being closed (their lingering close takes up to a second)."""
    stack = http_stacks["collapsed"]
    cap = HTTP_LIMITS["max_connections"]
    held = [connect(stack) for _ in range(cap)]
    burst = [connect(stack) for _ in range(2 * cap)]
    try:
        for sock in burst:
            sock.settimeout(5)
            assert sock.recv(4096).startswith(b"HTTP/1.1 503 ")
        body = json.dumps(GOOD).encode()
        for sock in held:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                         b"authorization: Bearer " + DEV_KEY.encode() + b"\r\ncontent-length: %d\r\n\r\n" % len(body)
                         + body)
        statuses = []
        for sock in held:
            sock.settimeout(30)
            statuses.append(sock.recv(4096).split(b"\r\n", 1)[0])
        assert statuses == [b"HTTP/1.1 200 OK"] * cap, statuses
    finally:
        for sock in [*held, *burst]:
            sock.close()


def test_connections_past_the_cap_are_answered_503_at_accept(http_stacks: dict[str, RunningStack]) -> None:
    stack = http_stacks["collapsed"]
    held = [connect(stack) for _ in range(HTTP_LIMITS["max_connections"])]
    try:
        with connect(stack) as extra:  # has sent nothing yet: refused at once
            extra.settimeout(5)
            answer = extra.recv(4096)
        assert answer.startswith(b"HTTP/1.1 503 "), answer[:200]
        assert b"retry-after: 1" in answer.lower()
    finally:
        for sock in held:
            sock.close()
    eventually(lambda: serves(stack), 5, "a request served again", interval=0.05)
