"""vLLM as the engine behind the spine, in both layouts, with the official SDKs as the clients.

One vLLM for the session (`vllm_engine`: SmolLM2-135M-Instruct, the directory `make model`
writes), a collapsed and a layered spine in front of it (`vllm_stacks`, router model
`VLLM_MODEL` an `upstream:`), and LiteLLM's proxy in front of the same engine. Every request is
greedy, so the engine's answer is one text: what the spine's clients get, plain or streamed,
over OpenAI's API or Anthropic's, must be the text vLLM gives when asked directly, and what
LiteLLM's clients get for the same requests.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from runtime.running_stack import RunningStack
from spine.tools.demo.litellm_gateway import LiteLLMGateway
from tests.vllm_server import (
    ENGINE_KEY,
    SERVED_NAME,
    VLLM_MODEL,
    engine_client,
    spine_anthropic,
    spine_openai,
)

# The first test here may start vLLM for the session (`vllm_engine`): minutes on a loaded 2-core host.
pytestmark = pytest.mark.timeout(900)
LAYOUTS = ("collapsed", "layered")
LITELLM_KEY = "sk-litellm-over-vllm"
QUESTION: Any = [{"role": "system", "content": "Answer in one short sentence."},
            {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def direct(vllm_engine: Any) -> openai.OpenAI:
    """vLLM itself, asked without the spine."""
    return engine_client(vllm_engine)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def litellm(vllm_engine: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    """LiteLLM's proxy (offline, loopback) in front of the same engine, serving it by the engine's name."""
    gateway = LiteLLMGateway(Path(tmp_path_factory.mktemp("litellm-vllm")), vllm_engine.base_url, ENGINE_KEY,
                             LITELLM_KEY, model=SERVED_NAME, timeout_s=120)
    gateway.start()
    try:
        yield openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=LITELLM_KEY, max_retries=0, timeout=120)
    finally:
        gateway.stop()


def engine_answer(direct: openai.OpenAI, messages: Any, max_tokens: int) -> Any:
    return direct.chat.completions.create(model=SERVED_NAME, messages=messages,
                                          max_tokens=max_tokens, temperature=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_plain_chat_is_vllms_own_answer(vllm_stacks: dict[str, RunningStack], direct: openai.OpenAI, layout: str) -> None:
    raw = spine_openai(vllm_stacks[layout]).chat.completions.with_raw_response.create(
        model=VLLM_MODEL, messages=QUESTION, max_tokens=16, temperature=0)
    answer, expected = raw.parse(), engine_answer(direct, QUESTION, 16)
    text = answer.choices[0].message.content
    assert text and text == expected.choices[0].message.content
    assert "Paris" in text  # the model directory decodes right under vLLM's transformers (spaces, newlines)
    assert raw.headers["x-spine-upstream"] == VLLM_MODEL and raw.headers["x-spine-layout"] == layout
    assert answer.usage is not None and expected.usage is not None
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (expected.usage.prompt_tokens,
                                                                            expected.usage.completion_tokens)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_streamed_chat_is_vllms_pieces_and_usage(vllm_stacks: dict[str, RunningStack], direct: openai.OpenAI,
                                                 layout: str) -> None:
    messages: Any = [{"role": "user", "content": f"Name three colours ({layout})."}]
    chunks = list(spine_openai(vllm_stacks[layout]).chat.completions.create(
        model=VLLM_MODEL, messages=messages, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    expected = engine_answer(direct, messages, 20)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.choices[0].message.content
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # piece by piece
    usage = chunks[-1].usage
    assert usage is not None and expected.usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (expected.usage.prompt_tokens,
                                                              expected.usage.completion_tokens)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_anthropic_client_gets_vllms_answer_plain_and_streamed(vllm_stacks: dict[str, RunningStack],
                                                                  direct: openai.OpenAI, layout: str) -> None:
    """Anthropic's Messages API over an OpenAI-protocol engine: the system prompt and the turn
    translated, the same greedy text back, with the engine's token counts."""
    claude = spine_anthropic(vllm_stacks[layout])
    ask: dict[str, Any] = {"model": VLLM_MODEL, "max_tokens": 16, "system": QUESTION[0]["content"],
                           "messages": [QUESTION[1]], "extra_body": {"temperature": 0}}
    expected = engine_answer(direct, QUESTION, 16)
    message = claude.messages.create(**ask)
    assert message.content[0].type == "text" and message.content[0].text == expected.choices[0].message.content
    assert expected.usage is not None and message.usage.output_tokens == expected.usage.completion_tokens
    with claude.messages.stream(**ask) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == expected.choices[0].message.content
    assert final.usage.output_tokens == expected.usage.completion_tokens


def test_litellm_over_the_same_vllm_gives_the_spines_answers(vllm_stacks: dict[str, RunningStack], litellm: openai.OpenAI,
                                                            direct: openai.OpenAI) -> None:
    """The migration's premise: the legacy gateway and the spine in front of one engine answer a
    greedy request alike, plain and streamed, so a parity gate compares like with like."""
    spine = spine_openai(vllm_stacks["collapsed"])
    prompts = ["Give me one word that rhymes with cat.", "What is 2 + 2? Answer with a number."]
    for prompt in prompts:
        messages: Any = [{"role": "user", "content": prompt}]
        ours = spine.chat.completions.create(model=VLLM_MODEL, messages=messages, max_tokens=12,
                                             temperature=0)
        theirs = litellm.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=12,
                                                 temperature=0)
        assert ours.choices[0].message.content == theirs.choices[0].message.content, prompt
        assert ours.choices[0].message.content == engine_answer(direct, messages, 12).choices[0].message.content
        streamed: Any = litellm.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=12,
                                                   temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
            ours.choices[0].message.content
