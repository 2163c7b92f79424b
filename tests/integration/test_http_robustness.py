"""Bad input over HTTP, slow and greedy clients: each gets a clear 4xx (or its connection is
closed), the process keeps serving everyone else, and both layouts decide alike (fuzzed)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.running_stack import RunningStack
from tests.conftest import DEV_KEY
from tests.http_helpers import HTTP_LIMITS, connect, raw
from tests.waiting import eventually

AUTH = {"authorization": f"Bearer {DEV_KEY}"}
GOOD = {"model": "tiny-lm", "max_tokens": 2, "messages": [{"role": "user", "content": "fine"}]}


@pytest.fixture
def stacks(http_stacks: dict[str, RunningStack]) -> dict[str, RunningStack]:
    return http_stacks


def still_serving(stack: RunningStack) -> None:
    with raw(stack) as client:
        answer = client.post("/v1/chat/completions", headers=AUTH, json=GOOD)
    assert answer.status_code == 200, answer.text


BAD_BODIES: list[tuple[str, bytes, dict[str, str], int, str]] = [
    ("/v1/chat/completions", b"{not json", {}, 400, "not valid JSON"),
    ("/v1/chat/completions", b'{"model": "tiny-lm", "messages": [{"role": "user", "content": "\xff\xfe"}]}', {},
     400, "UTF-8"),
    ("/v1/chat/completions", json.dumps(GOOD).encode(), {"content-type": "text/plain"}, 415, "content-type"),
    ("/v1/chat/completions", json.dumps({**GOOD, "max_tokens": "many"}).encode(), {}, 400, "max_tokens"),
    ("/v1/chat/completions", json.dumps({**GOOD, "max_tokens": True}).encode(), {}, 400, "max_tokens"),
    ("/v1/chat/completions", json.dumps({**GOOD, "max_tokens": -3}).encode(), {}, 400, "max_tokens"),
    ("/v1/chat/completions", json.dumps({**GOOD, "max_tokens": 10**15}).encode(), {}, 400, "max_tokens"),
    ("/v1/chat/completions", json.dumps({**GOOD, "temperature": "hot"}).encode(), {}, 400, "temperature"),
    ("/v1/chat/completions", json.dumps({**GOOD, "messages": [{"role": "wizard", "content": "x"}]}).encode(), {},
     400, "role"),
    ("/v1/chat/completions", json.dumps({**GOOD, "messages": []}).encode(), {}, 400, "messages"),
    ("/v1/chat/completions", json.dumps({**GOOD, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}).encode(), {}, 400, "text"),
    ("/v1/chat/completions", json.dumps([1, 2]).encode(), {}, 400, "JSON object"),
    ("/v1/chat/completions", json.dumps({**GOOD, "n": 3}).encode(), {}, 400, "n:"),
    ("/v1/chat/completions", json.dumps({**GOOD, "logprobs": True}).encode(), {}, 400, "logprobs"),  # built-ins honour stop
    ("/v1/chat/completions", json.dumps({**GOOD, "stop": 7}).encode(), {}, 400, "stop"),
    ("/v1/messages", json.dumps({"model": "tiny-lm", "messages": GOOD["messages"]}).encode(), {}, 400,
     "max_tokens: required"),
    ("/v1/messages", json.dumps({**GOOD, "messages": [{"role": "system", "content": "x"}]}).encode(), {}, 400,
     "role"),
    ("/v1/completions", json.dumps({"model": "tiny-lm", "prompt": 7}).encode(), {}, 400, "prompt"),
    ("/v1/chat/completions", b"x" * (HTTP_LIMITS["max_body_bytes"] + 1), {}, 413, "over the limit"),
]


@pytest.mark.parametrize("layout", ["collapsed", "layered"])
def test_bad_input_is_a_clear_4xx_and_the_process_keeps_serving(stacks: dict[str, RunningStack], layout: str) -> None:
    stack = stacks[layout]
    with raw(stack) as client:
        for path, body, headers, status, words in BAD_BODIES:
            answer = client.post(path, content=body, headers={"content-type": "application/json", **AUTH, **headers})
            assert answer.status_code == status, (path, body[:80], answer.text)
            error = answer.json()["error"]
            assert words in error["message"], (words, error)
            assert answer.headers["x-spine-layout"] == layout
        assert client.get("/v1/chat/completions").status_code == 405
        assert client.post("/v2/chat").status_code == 404
    still_serving(stack)


@pytest.mark.parametrize("layout", ["collapsed", "layered"])
def test_a_chunked_body_is_read_whole_and_under_the_same_limit(stacks: dict[str, RunningStack], layout: str) -> None:
    data = json.dumps(GOOD).encode()
    headers = {"content-type": "application/json", **AUTH}
    with raw(stacks[layout]) as client:
        answer = client.post("/v1/chat/completions", content=iter([data[:7], data[7:20], data[20:]]), headers=headers)
        huge = client.post("/v1/chat/completions", headers=headers,
                           content=iter([b" " * 1024] * (HTTP_LIMITS["max_body_bytes"] // 1024 + 1)))
    assert answer.request.headers["transfer-encoding"] == "chunked"
    assert answer.status_code == 200, answer.text
    assert huge.status_code == 413 and "http.max_body_bytes" in huge.json()["error"]["message"]
    still_serving(stacks[layout])


def test_a_body_declared_too_large_is_refused_before_it_is_read(stacks: dict[str, RunningStack]) -> None:
    stack = stacks["collapsed"]
    with connect(stack) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 100000000\r\n\r\n")
        head = sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 413")
    still_serving(stack)


def test_slow_headers_are_cut_off_and_others_are_served_meanwhile(stacks: dict[str, RunningStack]) -> None:
    stack = stacks["collapsed"]
    with connect(stack) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # and no more
        still_serving(stack)
        sock.settimeout(HTTP_LIMITS["read_timeout_s"] + 3)
        started = time.monotonic()
        assert sock.recv(4096) == b"", "the server closes a connection whose headers never end"
        assert time.monotonic() - started < HTTP_LIMITS["read_timeout_s"] + 2


def test_a_slow_body_gets_408(stacks: dict[str, RunningStack]) -> None:
    stack = stacks["collapsed"]
    with connect(stack) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                     b"authorization: Bearer " + DEV_KEY.encode() + b"\r\ncontent-length: 500\r\n\r\n{\"model\":")
        sock.settimeout(HTTP_LIMITS["read_timeout_s"] + 3)
        head = sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 408"), head[:100]
    still_serving(stack)


def test_connections_past_the_cap_are_refused_and_service_comes_back(stacks: dict[str, RunningStack]) -> None:
    stack = stacks["collapsed"]
    idle = [connect(stack) for _ in range(HTTP_LIMITS["max_connections"])]
    try:
        eventually(lambda: status_of_one(stack) == 503, 5, "a connection past the cap refused (503)",
                   interval=0.05, seen=lambda: status_of_one(stack))
    finally:
        for sock in idle:
            sock.close()
    eventually(lambda: status_of_one(stack) == 200, 3, "service back once the connections closed",
               interval=0.05, seen=lambda: status_of_one(stack))


def status_of_one(stack: RunningStack) -> int:
    """The status a good request gets on a connection of its own."""
    with raw(stack) as client:
        return int(client.post("/v1/chat/completions", headers=AUTH, json=GOOD).status_code)


def test_two_credentials_that_disagree_are_refused(stacks: dict[str, RunningStack]) -> None:
    with raw(stacks["collapsed"]) as client:
        answer = client.post("/v1/messages", headers={**AUTH, "x-api-key": "another"}, json={**GOOD, "max_tokens": 2})
    assert answer.status_code == 401 and answer.json()["error"]["type"] == "authentication_error"


def test_internal_headers_from_a_client_change_nothing(stacks: dict[str, RunningStack]) -> None:
    """A client naming internal metadata (a shadow mark, a tenant) is decided like any other:
    with no credential it is refused, whatever it claims."""
    with raw(stacks["collapsed"]) as client:
        answer = client.post("/v1/chat/completions", json=GOOD, headers={
            "x-spine-shadow": "1", "x-spine-tenant": "dev", "x-spine-internal": "yes"})
    assert answer.status_code == 401


# -- the same verdicts from both layouts, for whatever a client sends -------------------------
_TEXT = st.text(max_size=12)
_VALUE = st.one_of(st.none(), st.booleans(), st.integers(-5, 400), st.floats(allow_nan=False, allow_infinity=False),
                   _TEXT, st.lists(st.integers(0, 3), max_size=2))
_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "x"]),
                                  "content": st.one_of(_TEXT, st.integers(), st.lists(
                                      st.fixed_dictionaries({"type": st.sampled_from(["text", "image"]),
                                                             "text": _TEXT}), max_size=2))})
_BODY = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from(["tiny-lm", "mini", "gpt-9", "", 3]),
    "messages": st.one_of(st.lists(_MESSAGE, max_size=3), _VALUE),
    "prompt": st.one_of(_TEXT, _VALUE),
    "system": st.one_of(_TEXT, _VALUE),
    "max_tokens": _VALUE, "temperature": _VALUE, "seed": _VALUE, "stream": st.just(False),
})
_HEADERS = st.fixed_dictionaries({}, optional={
    "authorization": st.sampled_from([f"Bearer {DEV_KEY}", "Bearer nope", "Basic abc", "", f"bearer {DEV_KEY}"]),
    "x-api-key": st.sampled_from([DEV_KEY, "nope"]),
    "x-request-id": st.sampled_from(["plain-id-1", "not plain!", "x" * 100]),
    "content-type": st.sampled_from(["application/json", "application/json; charset=utf-8", "text/plain"]),
})


def _decide(stack: RunningStack, path: str, body: Any, headers: dict[str, str]) -> tuple[int, str]:
    with raw(stack) as client:
        answer = client.post(path, content=json.dumps(body).encode(),
                             headers={"content-type": "application/json", **headers})
    data = answer.json()
    if answer.status_code == 200:
        return 200, ""
    error = data["error"]
    return answer.status_code, error["type"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/messages"]), body=_BODY,
       headers=_HEADERS)
def test_fuzzed_requests_get_the_same_status_and_error_type_in_both_layouts(
        stacks: dict[str, RunningStack], path: str, body: dict[str, Any], headers: dict[str, str]) -> None:
    if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
        body["max_tokens"] = min(body["max_tokens"], 4)  # keep each answer short
    verdicts = {layout: _decide(stack, path, body, headers) for layout, stack in stacks.items()}
    assert verdicts["collapsed"] == verdicts["layered"], (path, body, headers)
    assert verdicts["collapsed"][0] < 500, (path, body, headers, verdicts)
