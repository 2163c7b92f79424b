"""A unary HTTP request through the spine over an upstream engine is served on one thread,
the HTTP server's event loop, from accept to answer: the gateway's stages, the model call and
the upstream exchange all run there (no handler thread, no second loop between them). A
request for a model that holds a thread while it works (the built-in one) keeps the handler
thread path, off the loop.

Real servers on 127.0.0.1: the collapsed spine with its HTTP API (`http_stacks`) and the bare
model server as its upstream engine. What touched the request is read from a pipeline hook
(every stage's call and the model's) and from the upstream endpoint's attempts."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from runtime.stack import Stack
from tests.http_helpers import UPSTREAM_MODELS, openai_client


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
def seen(http_stacks: dict[str, Stack]) -> Iterator[tuple[Stack, ThreadsSeen, list[int]]]:
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


def _loop_thread(stack: Stack) -> int:
    thread = stack.http_server._thread
    assert thread is not None and thread.ident is not None
    return int(thread.ident)


def test_a_unary_request_over_an_upstream_runs_on_the_http_loop_from_accept_to_answer(
        seen: tuple[Stack, ThreadsSeen, list[int]]) -> None:
    stack, hook, attempts = seen
    answer = openai_client(stack).chat.completions.create(
        model=UPSTREAM_MODELS[0], max_tokens=3, temperature=0, messages=[{"role": "user", "content": "one loop"}])
    assert answer.choices[0].message.content
    loop = _loop_thread(stack)
    components = {component for component, _ in hook.calls}
    assert {"auth", "ratelimit", "router", "inference"} <= components, hook.calls
    assert {thread for _, thread in hook.calls} == {loop}, [(c, t == loop) for c, t in hook.calls]
    assert attempts == [loop], "the upstream exchange ran on another thread"


def test_a_request_for_the_built_in_model_keeps_the_handler_thread_path(
        seen: tuple[Stack, ThreadsSeen, list[int]]) -> None:
    stack, hook, attempts = seen
    answer = openai_client(stack).chat.completions.create(
        model="default", max_tokens=2, temperature=0, messages=[{"role": "user", "content": "a built-in answer"}])
    assert answer.choices[0].message.content is not None
    loop = _loop_thread(stack)
    threads = {thread for _, thread in hook.calls}
    assert "inference" in {component for component, _ in hook.calls}
    assert loop not in threads, "the engine's wait (and its batched admission) must not hold the loop"
    assert attempts == []
