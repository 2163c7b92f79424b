"""The HTTP front in front of two real HTTP APIs: the session's layered stack plays the legacy
endpoint, its collapsed stack the spine (`http_stacks`); an unreachable legacy is a closed port.

What a foreign legacy side needs from the front, beyond the LiteLLM walk
(tests/end_to_end/test_legacy_litellm.py): answers streamed through as they come, the key translated
for the spine when the legacy endpoint reads it from a header of its own, no `x-spine-*`
header forwarded, a legacy endpoint that does not answer counted on its side and answered
in the client's API shape, shadow copies compared, bounded bodies."""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from migration.legacy_endpoint import endpoint
from migration.traffic.http_front import HttpFront
from migration.traffic.http_mirror import MirrorSettings
from runtime.config.http import HttpConfig
from runtime.http.server import HttpServer
from runtime.running_stack import RunningStack
from runtime.server import free_port
from tests.conftest import DEV_KEY
from tests.waiting import eventually

ASK = {"model": "tiny-lm", "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "Hi!"}]}


@contextlib.contextmanager
def serving(front: HttpFront) -> Iterator[str]:
    server = HttpServer(front, front.http, "127.0.0.1:0").start()  # the front reads under the same limits
    try:
        yield f"http://{server.address}"
    finally:
        front.close()
        server.stop(1.0)


@pytest.fixture
def sides(http_stacks: dict[str, RunningStack]) -> tuple[str, str]:
    """(legacy, spine) roots."""
    return f"http://{http_stacks['layered'].http_address}", f"http://{http_stacks['collapsed'].http_address}"


def test_answers_stream_through_and_each_side_gets_the_clients_key(sides: tuple[str, str]) -> None:
    legacy, spine = sides
    front = HttpFront(endpoint(legacy), spine, spine_weight=50)
    with serving(front) as url:
        sdk = openai.OpenAI(base_url=f"{url}/v1", api_key=DEV_KEY, max_retries=0)
        answers = {route: sdk.chat.completions.with_raw_response.create(**ASK, extra_headers={"x-spine-route": route})
                   for route in ("legacy", "spine")}
        with httpx.Client(timeout=10) as client, client.stream(
                "POST", f"{url}/v1/chat/completions", headers={"authorization": f"Bearer {DEV_KEY}",
                                                               "x-spine-route": "spine"},
                json={**ASK, "max_tokens": 8, "stream": True}) as stream:
            events = [line for line in stream.iter_lines() if line.startswith("data:")]
        claude = anthropic.Anthropic(base_url=url, api_key=DEV_KEY, max_retries=0)
        message = claude.messages.create(model="tiny-lm", max_tokens=4,
                                         messages=[{"role": "user", "content": "Hi!"}])
    assert {route: raw.headers["x-spine-side"] for route, raw in answers.items()} == {"legacy": "legacy",
                                                                                      "spine": "spine"}
    assert answers["legacy"].headers["x-spine-layout"] == "layered"  # each side's own server answered
    assert answers["spine"].headers["x-spine-layout"] == "collapsed"
    assert events[-1] == "data: [DONE]" and len(events) >= 3  # the stream's events, each as it came
    assert message.content and message.content[0].type == "text"


def test_a_key_in_a_header_of_the_gateways_own_reaches_the_spine_as_a_bearer_key(sides: tuple[str, str]) -> None:
    legacy, spine = sides
    front = HttpFront(endpoint(legacy, "apikey"), spine)  # Kong's key-auth header
    with serving(front) as url, httpx.Client(base_url=url, timeout=10) as client:
        to_spine = client.post("/v1/chat/completions", json=ASK, headers={"apikey": DEV_KEY, "x-spine-route": "spine"})
        wrong = client.post("/v1/chat/completions", json=ASK, headers={"apikey": "nope", "x-spine-route": "spine"})
    assert to_spine.status_code == 200, to_spine.text
    assert wrong.status_code == 401


def test_no_internal_header_reaches_a_side(sides: tuple[str, str]) -> None:
    """`x-spine-*` from a client is dropped: here a forged shadow mark and a layout claim."""
    legacy, spine = sides
    front = HttpFront(endpoint(legacy), spine, spine_weight=100)
    forwarded = front._forwarded([("authorization", f"Bearer {DEV_KEY}"), ("x-spine-shadow", "1.abc"),
                                  ("x-spine-tenant", "other"), ("x-session-id", "s"), ("connection", "close"),
                                  ("accept-encoding", "gzip")], "spine")
    assert dict(forwarded) == {"authorization": f"Bearer {DEV_KEY}", "x-session-id": "s",
                               "accept-encoding": "identity"}


def test_a_legacy_endpoint_that_does_not_answer_is_the_legacy_sides_error(sides: tuple[str, str]) -> None:
    _, spine = sides
    closed = f"http://127.0.0.1:{free_port()}"
    front = HttpFront(endpoint(closed), spine, spine_weight=0)
    started = time.time()
    with serving(front) as url:
        with pytest.raises(openai.InternalServerError) as raised:
            openai.OpenAI(base_url=f"{url}/v1", api_key=DEV_KEY, max_retries=0).chat.completions.create(**ASK)
        with pytest.raises(anthropic.InternalServerError) as claude:
            anthropic.Anthropic(base_url=url, api_key=DEV_KEY, max_retries=0).messages.create(
                model="tiny-lm", max_tokens=4, messages=[{"role": "user", "content": "Hi!"}])
        still = httpx.post(f"{url}/v1/chat/completions", json=ASK, timeout=10,
                           headers={"authorization": f"Bearer {DEV_KEY}", "x-spine-route": "spine"})
    assert raised.value.status_code == 502 and "could not be reached" in raised.value.message
    assert claude.value.status_code == 502
    assert still.status_code == 200  # the spine answers on
    window = front.window(started)
    assert (window["layered"].requests, window["layered"].errors) == (2, 2)
    assert (window["spine"].requests, window["spine"].errors) == (1, 0)


def test_shadow_copies_are_compared_and_a_body_over_the_limit_is_refused(sides: tuple[str, str]) -> None:
    legacy, spine = sides
    front = HttpFront(endpoint(legacy), spine, spine_weight=50, http=HttpConfig(max_body_bytes=4096),
                      mirror=MirrorSettings(share=1.0, calibration_share=0.0), rng=random.Random(7))
    with serving(front) as url:
        sdk = openai.OpenAI(base_url=f"{url}/v1", api_key=DEV_KEY, max_retries=0)
        for i in range(6):
            sdk.chat.completions.create(**{**ASK, "messages": [{"role": "user", "content": f"copy {i}"}]},
                                        extra_headers={"x-session-id": f"s{i}"})
        huge = httpx.post(f"{url}/v1/chat/completions", content=b"{" + b" " * 5000 + b"}", timeout=10,
                          headers={"authorization": f"Bearer {DEV_KEY}", "content-type": "application/json"})
        assert front.mirror is not None
        eventually(front.mirror.idle, timeout=10, what="every copy compared")
    counters = front.mirror.counters
    compared = counters.value("spine_shadow_compared_total", calibration="false")
    assert compared == 6  # every answer copied to the other side and compared
    assert counters.value("spine_shadow_mismatched_total") == 0  # the same model: the same greedy text
    assert huge.status_code == 413 and huge.json()["error"]["type"] == "invalid_request_error"


def test_a_head_past_the_limits_is_refused_in_the_apis_shape(sides: tuple[str, str]) -> None:
    legacy, spine = sides
    front = HttpFront(endpoint(legacy), spine)
    with serving(front) as url, httpx.Client(base_url=url, timeout=10) as client:
        huge = client.post("/v1/messages", json=ASK, headers={"authorization": f"Bearer {DEV_KEY}",
                                                              "x-padding": "p" * 70_000})
        after = client.post("/v1/chat/completions", json=ASK, headers={"authorization": f"Bearer {DEV_KEY}"})
    assert huge.status_code == 431 and huge.json()["type"] == "error"  # Anthropic's shape for /v1/messages
    assert after.status_code == 200  # the front serves on
