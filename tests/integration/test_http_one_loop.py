"""A unary HTTP request through the spine over an upstream engine is served on one thread,
the HTTP server's event loop, from accept to answer: the gateway's stages, the model call and
the upstream exchange all run there (no handler thread, no second loop between them). A
request for the built-in model is served there too: its outputs are handed to the loop once
per decode step. A stream over the upstream is served on the loop too, and a client that
hangs up ends the upstream exchange at once.

Real servers on 127.0.0.1: the collapsed spine with its HTTP API (`http_stacks`) and the bare
model server as its upstream engine. What touched the request is read from a pipeline hook
(every stage's call and the model's) and from the upstream endpoint's attempts."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import httpx2
import pytest

from runtime.running_stack import RunningStack
from tests.http_helpers import DEV_KEY, UPSTREAM_MODELS, openai_client
from tests.waiting import eventually


class ThreadsSeen:
    """A pipeline hook noting which thread called each component (it never blocks)."""

    may_block = False

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def begin(self, component: str, method: str, metadata: list[tuple[str, str]]) -> Any:
        self.calls.append((component, threading.get_ident()))
        return None

    def end(self, token: Any, code: grpc.StatusCode) -> None:
        return None


@pytest.fixture
def seen(http_stacks: dict[str, RunningStack]) -> Iterator[tuple[RunningStack, ThreadsSeen, list[int]]]:
    """The collapsed stack with the hook installed, and the threads its upstream attempts ran on."""
    stack = http_stacks["collapsed"]
    assert stack.pipeline is not None
    hook = ThreadsSeen()
    attempts: list[int] = []
    endpoint = stack.local_servicers["inference"].upstreams.endpoints[UPSTREAM_MODELS[0]]
    unary = endpoint.unary

    async def noted(request: Any, timeout_s: float) -> Any:
        attempts.append(threading.get_ident())
        return await unary(request, timeout_s)

    stack.pipeline.hooks.append(hook)
    endpoint.unary = noted
    try:
        yield stack, hook, attempts
    finally:
        stack.pipeline.hooks.remove(hook)
        del endpoint.unary


def _loop_thread(stack: RunningStack) -> int:
    thread = stack.http_server._thread
    assert thread is not None and thread.ident is not None
    return int(thread.ident)


def test_a_unary_request_over_an_upstream_runs_on_the_http_loop_from_accept_to_answer(
        seen: tuple[RunningStack, ThreadsSeen, list[int]]) -> None:
    stack, hook, attempts = seen
    answer = openai_client(stack).chat.completions.create(
        model=UPSTREAM_MODELS[0], max_tokens=3, temperature=0, messages=[{"role": "user", "content": "one loop"}])
    assert answer.choices[0].message.content
    loop = _loop_thread(stack)
    components = {component for component, _ in hook.calls}
    assert {"auth", "ratelimit", "router", "inference"} <= components, hook.calls
    assert {thread for _, thread in hook.calls} == {loop}, [(c, t == loop) for c, t in hook.calls]
    assert attempts == [loop], "the upstream exchange ran on another thread"


def test_a_request_for_the_built_in_model_runs_on_the_http_loop_too(
        seen: tuple[RunningStack, ThreadsSeen, list[int]]) -> None:
    stack, hook, attempts = seen
    answer = openai_client(stack).chat.completions.create(
        model="default", max_tokens=2, temperature=0, messages=[{"role": "user", "content": "a built-in answer"}])
    assert answer.choices[0].message.content is not None
    loop = _loop_thread(stack)
    assert {"auth", "ratelimit", "router", "inference"} <= {component for component, _ in hook.calls}, hook.calls
    assert {thread for _, thread in hook.calls} == {loop}, [(c, t == loop) for c, t in hook.calls]
    assert attempts == []


@pytest.fixture
def streams_seen(seen: tuple[RunningStack, ThreadsSeen, list[int]]) -> Iterator[tuple[RunningStack, ThreadsSeen, list[str]]]:
    """`seen`, and how each stream attempt at the upstream ended ("ended", "cancelled") and on which thread."""
    stack, hook, _ = seen
    endpoint = stack.local_servicers["inference"].upstreams.endpoints[UPSTREAM_MODELS[0]]
    stream = endpoint.stream
    ends: list[str] = []

    async def noted(request: Any, timeout_s: float, pieces: Any) -> None:
        where = "loop" if threading.get_ident() == _loop_thread(stack) else "elsewhere"
        try:
            await stream(request, timeout_s, pieces)
        except asyncio.CancelledError:
            ends.append(f"cancelled on {where}")
            raise
        ends.append(f"ended on {where}")

    endpoint.stream = noted
    try:
        yield stack, hook, ends
    finally:
        del endpoint.stream


def test_a_stream_over_an_upstream_runs_on_the_http_loop(streams_seen: tuple[RunningStack, ThreadsSeen, list[str]]) -> None:
    stack, hook, ends = streams_seen
    chunks = openai_client(stack).chat.completions.create(
        model=UPSTREAM_MODELS[0], max_tokens=4, temperature=0, stream=True,
        messages=[{"role": "user", "content": "a stream on one loop"}])
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text
    loop = _loop_thread(stack)
    assert "inference" in {component for component, _ in hook.calls}
    assert {thread for _, thread in hook.calls} == {loop}, [(c, t == loop) for c, t in hook.calls]
    assert ends == ["ended on loop"]


def hang_up_after_the_first_event(stack: RunningStack, prompt: str) -> None:
    """A client that asks for a long stream over HTTP, reads its first event and goes away."""
    with httpx2.Client(timeout=10) as raw, raw.stream(
            "POST", f"http://{stack.http_address}/v1/chat/completions", headers={"authorization": f"Bearer {DEV_KEY}"},
            json={"model": UPSTREAM_MODELS[0], "max_tokens": 256, "temperature": 0.8, "stream": True,
                  "messages": [{"role": "user", "content": prompt}]}) as answer:
        assert answer.status_code == 200
        next(answer.iter_lines())


def test_a_client_leaving_a_stream_on_the_loop_ends_the_upstream_exchange_at_once(
        streams_seen: tuple[RunningStack, ThreadsSeen, list[str]]) -> None:
    stack, _, ends = streams_seen
    endpoint = stack.local_servicers["inference"].upstreams.endpoints[UPSTREAM_MODELS[0]]
    hang_up_after_the_first_event(stack, "a long answer nobody reads")
    eventually(lambda: ends == ["cancelled on loop"], timeout=5, what=f"the upstream exchange cancelled: {ends}")
    eventually(lambda: endpoint.in_flight == 0, timeout=5, what="the upstream's slot given back")


class _NoThreadStub:
    """In place of a remote component's sync stub: a call from a handler thread fails loudly."""

    def __getattr__(self, rpc: str) -> Any:
        raise AssertionError(f"{rpc} went out on the sync stub, off the loop")


def test_a_layered_request_runs_on_the_http_loop_its_middlewares_and_model_awaited_there(
        http_stacks: dict[str, RunningStack]) -> None:
    """The layered gateway's HTTP API: every middleware and the model are other processes,
    awaited on their grpc.aio stubs from the HTTP loop (no handler thread): with every
    component's sync stub taken away, the request is still answered, and every call began on
    the loop's thread."""
    stack = http_stacks["layered"]
    assert stack.pipeline is not None
    hook = ThreadsSeen()
    placed = {name: stack.components.placed.named(name) for name in stack.components.registry.names}
    assert all(getattr(proxy, "awaits_on_loop", False) for proxy in placed.values()), placed
    stubs = {name: proxy.stub for name, proxy in placed.items()}  # type: ignore[attr-defined]
    stack.pipeline.hooks.append(hook)
    for proxy in placed.values():
        proxy.stub = _NoThreadStub()  # type: ignore[attr-defined]
    try:
        answer = openai_client(stack).chat.completions.create(
            model=UPSTREAM_MODELS[0], max_tokens=3, temperature=0, messages=[{"role": "user", "content": "layered"}])
    finally:
        stack.pipeline.hooks.remove(hook)
        for name, proxy in placed.items():
            proxy.stub = stubs[name]  # type: ignore[attr-defined]
    assert answer.choices[0].message.content
    loop = _loop_thread(stack)
    assert {"auth", "ratelimit", "router", "inference", "logs", "metrics"} <= {c for c, _ in hook.calls}, hook.calls
    assert {thread for _, thread in hook.calls} == {loop}, [(c, t == loop) for c, t in hook.calls]


def test_a_client_leaving_a_layered_stream_cancels_the_model_process_call(
        http_stacks: dict[str, RunningStack], monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream through the layered gateway's HTTP API reads the model process's stream on the
    loop; a client that hangs up cancels that call (recorded CANCELLED, not run to its end)."""
    stack = http_stacks["layered"]
    model = stack.components.placed.named("inference")
    ended: list[grpc.StatusCode] = []
    record = model._record  # type: ignore[attr-defined]

    def noted(code: grpc.StatusCode, timeout: float | None, error: BaseException | None) -> None:
        ended.append(code)
        record(code, timeout, error)

    monkeypatch.setattr(model, "_record", noted)
    hang_up_after_the_first_event(stack, "a long layered answer nobody reads")
    eventually(lambda: bool(ended), timeout=10, what="the model call's end recorded")
    assert ended == [grpc.StatusCode.CANCELLED]
    eventually(lambda: not model._inflight, timeout=5, what="no call left in flight")  # type: ignore[attr-defined]
