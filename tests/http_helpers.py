"""Shared set-up for the HTTP API's tests: both layouts with their HTTP listener, and clients."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai

from runtime.config.file import load_config, placements_for
from runtime.running_stack import RunningStack
from runtime.stack import Stack
from tests.bare_server import BareUpstream
from tests.conftest import DEV_KEY, config_for_tests

# A tenant that may hold one request at a time: the 429 path, and what a disconnect gives back.
SOLO_KEY = "solo-tenant-key-0000"
HTTP_LIMITS = {"max_body_bytes": 4096, "read_timeout_s": 1.0, "max_connections": 12}


# The models served by an upstream (a real bare model server, `tests.bare_server`): one over
# OpenAI's chat completions, one over Anthropic's Messages.
UPSTREAM_MODELS = ("upstream-tiny", "upstream-messages")


def http_config(upstream: BareUpstream | None = None, key_file: Path | None = None) -> dict[str, Any]:
    from tests.conftest import TEST_OVERRIDES

    keys = [*TEST_OVERRIDES["auth"]["api_keys"],
            {"id": "solo-key", "tenant": "solo", "key": SOLO_KEY, "scopes": ["generate"]}]
    extra: dict[str, Any] = {}
    if upstream is not None:
        base = [model.model_dump(exclude_none=True) for model in load_config().router.models]
        served = {"base_url": upstream.base_url, "api_key_file": str(key_file), "model": "default"}
        extra["router"] = {"models": [*base, {"id": UPSTREAM_MODELS[0], "upstream": served},
                                      {"id": UPSTREAM_MODELS[1], "upstream": {**served, "protocol": "anthropic"}}]}
    return config_for_tests(auth={"api_keys": keys},
                            ratelimit={"tenants": {**TEST_OVERRIDES["ratelimit"]["tenants"],
                                                   "solo": {"max_concurrent_requests": 1}}},
                            http=HTTP_LIMITS, **extra)


def start_http_stack(layout: str, tmp: Path, upstream: BareUpstream | None = None) -> RunningStack:
    key_file = None
    if upstream is not None and upstream.key is not None:
        key_file = tmp / "upstream.key"
        key_file.write_text(upstream.key + "\n")
    config = http_config(upstream, key_file)
    stack = Stack(config, placements_for(layout, config), run_dir=tmp / layout, http_listen="127.0.0.1:0").start()
    return stack


@contextlib.contextmanager
def http_layouts(tmp: Path, upstream: BareUpstream | None = None) -> Iterator[dict[str, RunningStack]]:
    stacks: dict[str, RunningStack] = {}
    try:
        for layout in ("collapsed", "layered"):
            stacks[layout] = start_http_stack(layout, tmp, upstream)
        yield stacks
    finally:
        for stack in stacks.values():
            stack.stop()


def base_url(stack: RunningStack) -> str:
    return f"http://{stack.http_address}"


def openai_client(stack: RunningStack, key: str = DEV_KEY, **options: Any) -> openai.OpenAI:
    options.setdefault("max_retries", 0)
    return openai.OpenAI(base_url=f"{base_url(stack)}/v1", api_key=key, **options)


def anthropic_client(stack: RunningStack, key: str = DEV_KEY, **options: Any) -> anthropic.Anthropic:
    options.setdefault("max_retries", 0)
    return anthropic.Anthropic(base_url=base_url(stack), api_key=key, **options)


def raw(stack: RunningStack) -> httpx.Client:
    return httpx.Client(base_url=base_url(stack), timeout=10.0)


def connect(stack: RunningStack) -> socket.socket:
    host, port = str(stack.http_address).rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5.0)


def sse_events(body: str) -> list[tuple[str, str]]:
    """(event, data) for each server-sent event ('' for an event without a name)."""
    events = []
    for block in body.split("\n\n"):
        name, data = "", []
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data.append(line[len("data: "):])
        if data:
            events.append((name, "\n".join(data)))
    return events


def sdk_round_trip(http_address: str) -> None:
    """The official SDKs get an answer from a `spine up`'s HTTP API (its ready line's
    `http_address`): one chat completion, one message. Greedy: the built-in model gives EOS a
    small probability, so a sampled answer may rightly stop before `max_tokens`."""
    assert http_address.startswith("127.0.0.1:") and not http_address.endswith(":0"), http_address
    chat = openai.OpenAI(base_url=f"http://{http_address}/v1", api_key=DEV_KEY, max_retries=0)
    answer = chat.chat.completions.create(model="default", max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": "hello from the cli"}])
    assert answer.choices[0].message.content and answer.usage is not None and answer.usage.completion_tokens == 4
    assert answer.choices[0].finish_reason == "length"
    message = anthropic.Anthropic(base_url=f"http://{http_address}", api_key=DEV_KEY, max_retries=0).messages.create(
        model="default", max_tokens=3, extra_body={"temperature": 0}, messages=[{"role": "user", "content": "hello from the cli"}])
    assert message.usage.output_tokens == 3 and message.stop_reason == "max_tokens"
