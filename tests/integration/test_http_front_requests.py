"""What a client can send the migration's HTTP front, tried as an attacker would: requests it
cannot form, bodies that never finish, chunked bodies. The sides are two real HTTP servers
(a small echo app on spine's own HTTP server) and the front is served as `spine migrate`
serves it, by `HttpServer` on the front's own limits.

The gates read the front's window: only the sides' own answers may reach it. A request the
front refuses itself (400, 408, 413) must count for neither side, or a client could choose
when a rollout rolls back."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from migration.legacy_endpoint import endpoint
from migration.traffic.http_front import HttpFront
from runtime.config.http import HttpConfig
from runtime.http.bounded_protocol import plain_refusal
from runtime.http.server import HttpServer
from tests.waiting import eventually

LIMITS = HttpConfig(max_body_bytes=4096, read_timeout_s=0.5, max_connections=6)


class EchoSide:
    """A side: answers 200 with what it got (method, target, body), as JSON."""

    refusal = staticmethod(plain_refusal)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        target = scope["raw_path"].decode() + ("?" + scope["query_string"].decode() if scope["query_string"] else "")
        answer = orjson.dumps({"method": scope["method"], "target": target, "body": body.decode("latin-1")})
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": answer})


@pytest.fixture(scope="module")
def side() -> Iterator[str]:
    server = HttpServer(EchoSide(), HttpConfig(), "127.0.0.1:0").start()
    try:
        yield f"http://{server.address}"
    finally:
        server.stop(1.0)


@contextlib.contextmanager
def front_on(side: str) -> Iterator[tuple[HttpFront, str]]:
    front = HttpFront(endpoint(side), side, spine_weight=50, http=LIMITS)
    server = HttpServer(front, front.http, "127.0.0.1:0").start()
    try:
        yield front, server.address
    finally:
        front.close()
        server.stop(1.0)


def exchange(address: str, head: bytes, body: bytes = b"") -> bytes:
    """Send a raw request; everything the front answers until it closes or has answered."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head + b"\r\nhost: front\r\nx-spine-route: spine\r\nconnection: close\r\n\r\n" + body)
        return read_all(sock)


def read_all(sock: socket.socket) -> bytes:
    answer = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def payload(answer: bytes) -> bytes:
    """The body of a raw answer, its chunks joined (the front streams what a side answers)."""
    head, _, rest = answer.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" not in head.lower():
        return rest
    out = b""
    while True:
        size, _, rest = rest.partition(b"\r\n")
        if int(size, 16) == 0:
            return out
        out, rest = out + rest[:int(size, 16)], rest[int(size, 16) + 2:]


def counted(front: HttpFront) -> dict[str, tuple[int, int]]:
    return {side: (window.requests, window.errors) for side, window in front.window(0).items()}


UNFORMABLE = [
    (b"OPTIONS * HTTP/1.1", b"OPTIONS '*' names none"),
    (b"M-SEARCH * HTTP/1.1", b"M-SEARCH '*' names none"),
    (b"GET /v1/models HTTP/1.1\r\nx-note: caf\xe9", b"outside ASCII"),  # httpx refuses to send it on
]


@pytest.mark.parametrize(("head", "says"), UNFORMABLE, ids=["options-star", "m-search-star", "non-ascii-header"])
def test_a_request_the_front_cannot_form_is_400_and_counted_for_neither_side(
        side: str, head: bytes, says: bytes) -> None:
    with front_on(side) as (front, address):
        answers = [exchange(address, head + b"\r\ncontent-length: 0") for _ in range(20)]
        normal = httpx.get(f"http://{address}/v1/models", headers={"x-spine-route": "spine"}, timeout=10)
        window = counted(front)
    for answer in answers:
        assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
        assert says in answer and b"Traceback" not in answer, answer
        assert b'"invalid_request_error"' in answer  # the API's error shape
    assert normal.status_code == 200  # the front serves on
    assert window == {"layered": (0, 0), "spine": (1, 0)}  # the twenty 400s reached no gate


@pytest.mark.parametrize("target", [b"http://elsewhere.example/v1/models?x=1", b"//elsewhere.example/v1/models"])
def test_an_odd_target_reaches_the_chosen_side_as_a_path_on_it(side: str, target: bytes) -> None:
    with front_on(side) as (front, address):
        answer = exchange(address, b"GET " + target + b" HTTP/1.1")
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    got = orjson.loads(payload(answer))
    assert got["target"] in ("/v1/models?x=1", "//elsewhere.example/v1/models")  # never a request to elsewhere
    assert counted(front)["spine"] == (1, 0)


def test_a_body_that_stops_arriving_is_answered_408_and_counted_for_neither_side(side: str) -> None:
    with front_on(side) as (front, address):
        answer = exchange(address, b"POST /v1/chat/completions HTTP/1.1\r\ncontent-type: application/json\r\n"
                                   b"content-length: 1000", b"{")  # then nothing
        window = counted(front)
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert b"http.read_timeout_s" in answer
    assert window == {"layered": (0, 0), "spine": (0, 0)}


def test_a_body_sent_a_byte_at_a_time_is_cut_off_at_the_same_deadline(side: str) -> None:
    with front_on(side) as (_, address):
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /v1/messages HTTP/1.1\r\nhost: front\r\ncontent-length: 1000\r\n\r\n")
            sock.settimeout(0.05)
            answer = b""
            for _ in range(400):  # a byte every 50 ms (or as fast as the answer comes) until answered
                with contextlib.suppress(OSError):
                    sock.send(b"x")
                with contextlib.suppress(TimeoutError, BlockingIOError):
                    answer += sock.recv(65536)
                if b"\r\n\r\n" in answer:
                    break
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert b'"type":"error"' in answer  # /v1/messages: Anthropic's error shape


def test_stalled_bodies_hold_the_front_only_until_their_deadline(side: str) -> None:
    """As many stalled bodies as the front serves connections at once (uvicorn's cap counts the
    next one as well): each is cut off 408 at the body deadline, and a client is served then."""
    with front_on(side) as (_, address):
        host, port = address.rsplit(":", 1)
        stalled = [socket.create_connection((host, int(port)), timeout=10) for _ in range(LIMITS.max_connections - 1)]
        try:
            for sock in stalled:
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: front\r\ncontent-length: 1000\r\n\r\n{")
            answers = [read_all(sock) for sock in stalled]
            after = eventually(lambda: httpx.get(f"http://{address}/v1/models", timeout=10).status_code == 200,
                               what="a client served once the stalled bodies are cut off")
        finally:
            for sock in stalled:
                sock.close()
    assert all(answer.startswith(b"HTTP/1.1 408 ") for answer in answers), [a[:40] for a in answers]
    assert after


def test_a_chunked_body_is_read_under_the_same_limit(side: str) -> None:
    with front_on(side) as (front, address):
        small = httpx.post(f"http://{address}/v1/chat/completions", content=iter([b'{"a":', b' "b"}']),
                           headers={"x-spine-route": "spine", "content-type": "application/json"}, timeout=10)
        huge = httpx.post(f"http://{address}/v1/chat/completions", content=iter([b"x" * 1024] * 8),
                          headers={"x-spine-route": "spine", "content-type": "application/json"}, timeout=10)
        window = counted(front)
    assert small.request.headers["transfer-encoding"] == "chunked"
    assert small.status_code == 200 and small.json()["body"] == '{"a": "b"}'  # the side got it whole
    assert huge.status_code == 413 and "http.max_body_bytes" in huge.json()["error"]["message"]
    assert window["spine"] == (1, 0)


METHODS = st.sampled_from(["GET", "POST", "HEAD", "OPTIONS", "PUT", "DELETE", "PATCH", "TRACE", "PROPFIND",
                           "M-SEARCH", "PURGE", "CONNECT", "BREW"])
PATH_BYTES = st.binary(min_size=0, max_size=12).map(lambda raw: bytes(b for b in raw if b > 0x20 and b != 0x7f))
TARGETS = st.one_of(
    st.just(b"*"),
    st.builds(lambda p: b"/" + p, PATH_BYTES),
    st.builds(lambda p: b"http://elsewhere.example/" + p, PATH_BYTES),
    st.builds(lambda p: b"//elsewhere.example/" + p, PATH_BYTES),
    st.builds(lambda p: b"/v1/chat/completions?" + p, PATH_BYTES),
)
VALUES = st.binary(min_size=0, max_size=8).map(lambda raw: bytes(b for b in raw if b >= 0x20 and b != 0x7f))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=METHODS, target=TARGETS, value=VALUES)
def test_fuzzed_requests_never_get_a_500_and_only_the_sides_answers_are_counted(
        side: str, method: str, target: bytes, value: bytes) -> None:
    with front_on(side) as (front, address):
        answer = exchange(address, method.encode() + b" " + target + b" HTTP/1.1\r\nx-note: " + value +
                          b"\r\ncontent-length: 0")
        head = answer.partition(b"\r\n\r\n")[0].lower()
        status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0
        assert 400 <= status < 500 or b"x-spine-side: spine" in head, answer[:300]  # the front's own: a 4xx
        answered_by_side = b"x-spine-side: spine" in head
        eventually(lambda: counted(front)["spine"] == (1 if answered_by_side else 0, 0),
                   what="the side's answer counted, the front's own not", seen=lambda: counted(front))
        assert counted(front)["layered"] == (0, 0)
