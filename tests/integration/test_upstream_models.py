"""A router model with `upstream:` serves chat completions, plain and streamed, in both layouts.

The upstream is a real bare model server (`spine up --layout bare`, with an API key), shared
with the other HTTP tests (`http_stacks`); the official SDKs are the clients. The answer
must be the upstream's own (the same greedy text the bare server gives when asked
directly), with its usage, and say which upstream served it after how many attempts."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from runtime.running_stack import RunningStack
from tests.conftest import DEV_KEY
from tests.http_helpers import UPSTREAM_MODELS, anthropic_client, openai_client

LAYOUTS = ("collapsed", "layered")


@pytest.fixture(scope="module")
def direct(bare_http_upstream: Any) -> openai.OpenAI:
    """The bare server itself, asked without the spine."""
    return openai.OpenAI(base_url=bare_http_upstream.base_url, api_key=bare_http_upstream.key, max_retries=0)


def _ask(client: openai.OpenAI, model: str, prompt: str) -> Any:
    return client.chat.completions.with_raw_response.create(
        model=model, max_tokens=6, temperature=0, messages=[{"role": "user", "content": prompt}])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_plain_chat_is_the_upstreams_answer_with_its_headers(http_stacks: dict[str, RunningStack], direct: openai.OpenAI,
                                                             layout: str) -> None:
    prompt = f"upstream plain {layout}"
    raw = _ask(openai_client(http_stacks[layout]), UPSTREAM_MODELS[0], prompt)
    answer, expected = raw.parse(), direct.chat.completions.create(
        model="default", max_tokens=6, temperature=0, messages=[{"role": "user", "content": prompt}])
    assert answer.choices[0].message.content == expected.choices[0].message.content
    assert answer.model == UPSTREAM_MODELS[0]
    assert answer.usage is not None and expected.usage is not None
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (expected.usage.prompt_tokens, 6)
    assert raw.headers["x-spine-upstream"] == UPSTREAM_MODELS[0] and raw.headers["x-spine-attempts"] == "1"
    assert raw.headers["x-spine-layout"] == layout
    assert float(raw.headers["x-spine-overhead-duration-ms"]) >= 0.0
    assert float(raw.headers["x-spine-upstream-duration-ms"]) > 0.0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_streamed_chat_passes_the_upstreams_deltas_and_usage(http_stacks: dict[str, RunningStack], direct: openai.OpenAI,
                                                             layout: str) -> None:
    prompt = f"upstream stream {layout}"
    raw = openai_client(http_stacks[layout]).chat.completions.with_raw_response.create(
        model=UPSTREAM_MODELS[0], max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": prompt}])
    assert raw.headers["x-spine-upstream"] == UPSTREAM_MODELS[0] and raw.headers["x-spine-attempts"] == "1"
    assert float(raw.headers["x-spine-overhead-duration-ms"]) >= 0.0
    chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    expected = direct.chat.completions.create(model="default", max_tokens=6, temperature=0,
                                              messages=[{"role": "user", "content": prompt}])
    assert text == expected.choices[0].message.content
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # piece by piece, not one lump
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 6 and expected.usage is not None
    assert usage.prompt_tokens == expected.usage.prompt_tokens


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_anthropic_upstream_and_an_anthropic_client(http_stacks: dict[str, RunningStack], layout: str) -> None:
    raw = _ask(openai_client(http_stacks[layout]), UPSTREAM_MODELS[1], f"upstream messages {layout}")
    assert raw.headers["x-spine-upstream"] == UPSTREAM_MODELS[1]
    assert raw.parse().usage is not None and raw.parse().usage.completion_tokens == 6
    claude = anthropic_client(http_stacks[layout])
    with claude.messages.stream(model=UPSTREAM_MODELS[0], max_tokens=5, extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": f"claude via upstream {layout}"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.usage.output_tokens == 5


def test_every_answer_says_its_overhead(http_stacks: dict[str, RunningStack]) -> None:
    """The built-in model's answers, a refusal and a stream carry it too."""
    client = openai_client(http_stacks["collapsed"])
    local = _ask(client, "default", "overhead of a local model")
    assert float(local.headers["x-spine-overhead-duration-ms"]) >= 0 and "x-spine-upstream" not in local.headers
    with pytest.raises(openai.AuthenticationError) as refused:
        openai_client(http_stacks["collapsed"], key="no-such-key").chat.completions.create(
            model="default", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    assert float(refused.value.response.headers["x-spine-overhead-duration-ms"]) >= 0
    with pytest.raises(openai.BadRequestError) as bad:  # refused by the front itself, before the gateway
        client.chat.completions.create(model="default", max_tokens=2, messages=[])
    assert float(bad.value.response.headers["x-spine-overhead-duration-ms"]) >= 0


def test_grpc_clients_get_the_upstream_in_trailers(http_stacks: dict[str, RunningStack]) -> None:
    from spine.client.gateway_client import GatewayClient
    from wire.v1 import generation_pb2

    for layout in LAYOUTS:
        with GatewayClient(http_stacks[layout].address, DEV_KEY) as client:
            result = client.generate(generation_pb2.GenerateRequest(model=UPSTREAM_MODELS[0], prompt=f"grpc {layout}",
                                                                    max_tokens=3))
        assert result.ok and result.trailing["x-spine-upstream"] == UPSTREAM_MODELS[0], result.details
        assert "x-spine-overhead-duration-ms" in result.trailing
