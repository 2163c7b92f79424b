"""The HTTP API with the official SDKs as clients, in both layouts: answers, streams, usage,
errors as each SDK's exception classes, Retry-After, headers, and parity with gRPC."""

from __future__ import annotations

import json
import threading
from typing import Any

import anthropic
import httpx
import openai
import pytest

from runtime.running_stack import RunningStack
from spine.client.gateway_client import GatewayClient
from tests.conftest import DEV_KEY
from tests.http_helpers import SOLO_KEY, UPSTREAM_MODELS, anthropic_client, openai_client, raw, sse_events
from tests.waiting import eventually
from wire.v1 import generation_pb2

LAYOUTS = ("collapsed", "layered")
# Its greedy answer runs all 250 tokens: a request that holds its slot for a while.
LONG_PROMPT = "a long greedy answer for collapsed"


@pytest.fixture
def stacks(http_stacks: dict[str, RunningStack]) -> dict[str, RunningStack]:
    return http_stacks


def chat(client: openai.OpenAI, prompt: str, **extra: Any) -> Any:
    return client.chat.completions.create(model="tiny-lm", messages=[{"role": "user", "content": prompt}],
                                          max_tokens=extra.pop("max_tokens", 8), temperature=0, **extra)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_openai_chat_plain_and_streamed_match_grpc(stacks: dict[str, RunningStack], layout: str) -> None:
    stack = stacks[layout]
    client = openai_client(stack)
    plain = chat(client, f"http chat {layout}")
    assert plain.object == "chat.completion" and plain.model == "tiny-lm"
    choice = plain.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("length", "stop")
    assert plain.usage is not None and plain.usage.completion_tokens == 8 and plain.usage.prompt_tokens > 0
    # The same request over gRPC (one user message is the prompt as it is): the same answer.
    with GatewayClient(stack.address, DEV_KEY) as grpc_client:
        direct = grpc_client.generate(generation_pb2.GenerateRequest(
            model="tiny-lm", prompt=f"http chat {layout}", max_tokens=8))
    assert direct.ok and direct.response.text == choice.message.content
    # Streamed, with usage: a fresh prompt, so the model streams it token by token.
    chunks = list(chat(client, f"http stream {layout}", stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes in (["length"], ["stop"])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1, "token by token"
    again = chat(client, f"http stream {layout}")  # now a cache hit: the same text
    assert again.choices[0].message.content == text
    assert chunks[-1].usage.completion_tokens == again.usage.completion_tokens


def test_both_layouts_answer_alike(stacks: dict[str, RunningStack]) -> None:
    answers = {layout: chat(openai_client(stack), "http parity", seed=3).choices[0].message.content
               for layout, stack in stacks.items()}
    assert answers["layered"] == answers["collapsed"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_openai_completions_and_models(stacks: dict[str, RunningStack], layout: str) -> None:
    client = openai_client(stacks[layout])
    completion = client.completions.create(model="default", prompt="http completion", max_tokens=5, temperature=0)
    assert completion.object == "text_completion" and completion.model == "tiny-lm"
    assert completion.usage is not None and completion.usage.completion_tokens == 5
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="default", prompt="http completion stream", max_tokens=5, temperature=0, stream=True))
    assert streamed == client.completions.create(model="default", prompt="http completion stream", max_tokens=5,
                                                 temperature=0).choices[0].text
    assert {m.id for m in client.models.list()} == {"tiny-lm", "default", "tiny", "tiny-lm-mini", "mini",
                                                    *UPSTREAM_MODELS}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_anthropic_message_plain_and_streamed(stacks: dict[str, RunningStack], layout: str) -> None:
    client = anthropic_client(stacks[layout])
    message = client.messages.create(model="tiny-lm", max_tokens=6, system="Be brief.",
                                     messages=[{"role": "user", "content": f"http message {layout}"}],
                                     extra_body={"temperature": 0})
    assert message.type == "message" and message.role == "assistant" and message.model == "tiny-lm"
    assert message.content[0].type == "text" and message.stop_reason in ("max_tokens", "end_turn")
    assert message.usage.output_tokens == 6 and message.usage.input_tokens > 0
    with client.messages.stream(model="tiny-lm", max_tokens=6, system="Be brief.",
                                messages=[{"role": "user", "content": f"http message stream {layout}"}],
                                extra_body={"temperature": 0}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds and "message_delta" in kinds
    assert final.usage.output_tokens == 6 and final.content[0].text


def test_anthropic_stream_is_the_documented_event_sequence(stacks: dict[str, RunningStack]) -> None:
    with raw(stacks["collapsed"]) as client:
        answer = client.post("/v1/messages", headers={"x-api-key": DEV_KEY}, json={
            "model": "tiny-lm", "max_tokens": 4, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "http documented sequence"}]})
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
    events = sse_events(answer.text)
    names = [name for name, _ in events]
    deltas = [n for n in names if n == "content_block_delta"]
    assert names == ["message_start", "content_block_start", "ping", *deltas, "content_block_stop",
                     "message_delta", "message_stop"]
    assert len(deltas) >= 2
    for name, data in events:
        assert json.loads(data)["type"] == name


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sdk_exception_classes(stacks: dict[str, RunningStack], layout: str) -> None:
    stack = stacks[layout]
    with pytest.raises(openai.AuthenticationError):
        chat(openai_client(stack, key="wrong-key"), "http auth")
    with pytest.raises(anthropic.AuthenticationError):
        anthropic_client(stack, key="wrong-key").messages.create(
            model="tiny-lm", max_tokens=4, messages=[{"role": "user", "content": "http auth"}])
    with pytest.raises(openai.NotFoundError, match="unknown model"):
        openai_client(stack).chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.NotFoundError, match="unknown model"):
        anthropic_client(stack).messages.create(model="claude-9", max_tokens=4,
                                                messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        chat(openai_client(stack), "http too many", max_tokens=100_000)
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        anthropic_client(stack).messages.create(model="tiny-lm", max_tokens=0,
                                                messages=[{"role": "user", "content": "x"}])


def _hold_a_slot(stack: RunningStack, started: threading.Event, done: threading.Event, label: str) -> threading.Thread:
    """The solo tenant's one slot, held by a long stream until `done`'s reader drains it."""
    def hold() -> None:
        with raw(stack) as client, client.stream("POST", "/v1/chat/completions", headers={
                "authorization": f"Bearer {SOLO_KEY}"}, json={
                "model": "tiny-lm", "max_tokens": 250, "temperature": 0, "stream": True,
                "messages": [{"role": "user", "content": f"{LONG_PROMPT} {label}"}]}) as answer:
            assert answer.status_code == 200
            for _ in answer.iter_lines():
                started.set()
        done.set()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert started.wait(10), "the long stream did not start"
    return thread


@pytest.mark.parametrize("layout", LAYOUTS)
def test_over_the_concurrency_limit_is_429_with_retry_after_and_the_sdk_retries(stacks: dict[str, RunningStack],
                                                                              layout: str) -> None:
    stack = stacks[layout]
    started, done = threading.Event(), threading.Event()
    holder = _hold_a_slot(stack, started, done, "held")
    try:
        with raw(stack) as client:
            refused = client.post("/v1/chat/completions", headers={"authorization": f"Bearer {SOLO_KEY}"}, json={
                "model": "tiny-lm", "max_tokens": 2, "messages": [{"role": "user", "content": "second"}]})
        assert not done.is_set(), "250 tokens outlast two requests"
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["retry-after"]) >= 1 and float(refused.headers["retry-after-ms"]) > 0
        assert "concurrent_requests" in refused.json()["error"]["message"]
        assert refused.json()["error"]["type"] == "rate_limit_error"
        with pytest.raises(openai.RateLimitError):
            chat(openai_client(stack, key=SOLO_KEY), "second, by the sdk", max_tokens=2)
    finally:
        holder.join(30)
    assert done.is_set()
    # The SDK's own retry honours Retry-After: refused while a slot is held, it waits as told
    # and asks again until the slot is free.
    started, done = threading.Event(), threading.Event()
    holder = _hold_a_slot(stack, started, done, "held again")
    try:
        seen: list[tuple[int, str | None]] = []
        sdk = openai_client(stack, key=SOLO_KEY, max_retries=100, http_client=httpx.Client(event_hooks={
            "response": [lambda response: seen.append((response.status_code,
                                                       response.headers.get("retry-after-ms")))]}))
        answer = chat(sdk, "after the retry", max_tokens=2)
    finally:
        holder.join(30)
    assert answer.choices[0].message.content is not None
    assert seen[0][0] == 429 and seen[0][1] is not None and seen[-1][0] == 200, seen


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_answer_carries_the_headers(stacks: dict[str, RunningStack], layout: str) -> None:
    with raw(stacks[layout]) as client:
        answers = [
            client.post("/v1/chat/completions", headers={"authorization": f"Bearer {DEV_KEY}"},
                        json={"model": "tiny-lm", "max_tokens": 2, "messages": [{"role": "user", "content": "h"}]}),
            client.post("/v1/messages", headers={"x-api-key": "wrong"},
                        json={"model": "tiny-lm", "max_tokens": 2, "messages": [{"role": "user", "content": "h"}]}),
            client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}),
            client.get("/v1/nowhere"),
        ]
    assert [a.status_code for a in answers] == [200, 401, 400, 404]
    for answer in answers:
        assert answer.headers["x-spine-layout"] == layout
        assert len(answer.headers["x-request-id"]) >= 16
        hint = json.loads(answer.headers["x-gpu-load-hint"])
        assert "sm_util" in hint and "vram_free_gb" in hint
    hint = json.loads(answers[0].headers["x-gpu-load-hint"])
    assert hint["slots"] > 0 and 0 <= hint["sm_util"] <= 100 and hint["vram_free_gb"] > 0
    assert answers[1].json()["error"]["type"] == "authentication_error"


def test_a_callers_request_id_is_kept(stacks: dict[str, RunningStack]) -> None:
    with raw(stacks["collapsed"]) as client:
        answer = client.post("/v1/chat/completions", headers={"authorization": f"Bearer {DEV_KEY}",
                                                              "x-request-id": "my-call-42"},
                             json={"model": "tiny-lm", "max_tokens": 2, "messages": [{"role": "user", "content": "i"}]})
    assert answer.headers["x-request-id"] == "my-call-42" and answer.json()["id"] == "chatcmpl-my-call-42"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_client_that_leaves_mid_stream_frees_its_slot_at_once(stacks: dict[str, RunningStack], layout: str) -> None:
    stack = stacks[layout]
    with raw(stack) as client, client.stream("POST", "/v1/chat/completions", headers={
            "authorization": f"Bearer {SOLO_KEY}"}, json={
            "model": "tiny-lm", "max_tokens": 250, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": LONG_PROMPT + " left"}]}) as answer:
        assert answer.status_code == 200
        next(answer.iter_lines())  # one event, then hang up
    # The tenant's one slot comes back with the disconnect, long before 250 tokens would end.
    with raw(stack) as client:
        answers: list[Any] = []

        def admitted() -> bool:
            answers.append(client.post("/v1/chat/completions", headers={"authorization": f"Bearer {SOLO_KEY}"}, json={
                "model": "tiny-lm", "max_tokens": 2, "messages": [{"role": "user", "content": "after leaving"}]}))
            return bool(answers[-1].status_code == 200)

        eventually(admitted, 3.0, "the tenant's slot back", interval=0.05, seen=lambda: answers[-1].text)
    if layout == "collapsed":  # the model's own KV slots: none held by the abandoned stream
        inference = stack.local_servicers["inference"].first
        eventually(lambda: inference.scheduler.running_count == 0, 3.0, "no KV slot held", interval=0.05)
