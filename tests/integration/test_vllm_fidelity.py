"""What an agent or RAG client sends reaches vLLM through the spine, in both layouts, and vLLM's
answer comes back: forced tool calls and their results, JSON-schema answers, stop strings,
logprobs, the engine's own 4xx for an image, embeddings, the Responses API, and an Anthropic
client's tools over the engine's OpenAI protocol — each checked against vLLM asked directly
(every request greedy, so the engine's answer is one).

The session's vLLM (`vllm_engine`) and the stacks in front of it (`vllm_stacks`) are shared
with tests/integration/test_vllm_upstream.py; the tests skip, saying why, where vLLM is not
installed (`make engine`).
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from runtime.running_stack import RunningStack
from tests.vllm_server import SERVED_NAME, VLLM_MODEL, engine_client, spine_anthropic, spine_openai

pytestmark = pytest.mark.timeout(900)
LAYOUTS = ("collapsed", "layered")

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}
# strict: vLLM holds the call's arguments to the schema (without it this model's forced call
# answers a bare string: the engine's answer, which the spine passes on as it is).
WEATHER: Any = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": CITY, "strict": True}}
ASK_WEATHER: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCED: Any = {"type": "function", "function": {"name": "get_weather"}}
PLACE = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
         "required": ["city", "country"], "additionalProperties": False}
PIXEL = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAA"
         "ABJRU5ErkJggg==")


@pytest.fixture(scope="module")
def direct(vllm_engine: Any) -> openai.OpenAI:
    """vLLM itself, asked without the spine."""
    return engine_client(vllm_engine)  # type: ignore[no-any-return]


def _both(stack: RunningStack, client: openai.OpenAI, **ask: Any) -> tuple[Any, Any]:
    """The same greedy request through the spine and to vLLM directly."""
    ours = spine_openai(stack).chat.completions.create(model=VLLM_MODEL, temperature=0, **ask)
    theirs = client.chat.completions.create(model=SERVED_NAME, temperature=0, **ask)
    return ours, theirs


def _call(message: Any) -> tuple[str, Any]:
    (call,) = message.tool_calls
    return call.function.name, json.loads(call.function.arguments)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_named_tool_choice_forces_the_call_and_the_tool_result_gets_vllms_answer(
        vllm_stacks: dict[str, RunningStack], direct: openai.OpenAI, layout: str) -> None:
    stack = vllm_stacks[layout]
    ours, theirs = _both(stack, direct, messages=ASK_WEATHER, tools=[WEATHER], tool_choice=FORCED, max_tokens=60)
    assert _call(ours.choices[0].message) == _call(theirs.choices[0].message)
    name, arguments = _call(ours.choices[0].message)
    assert name == "get_weather" and set(arguments) == {"city"}
    streamed = spine_openai(stack).chat.completions.create(
        model=VLLM_MODEL, temperature=0, messages=ASK_WEATHER, tools=[WEATHER], tool_choice=FORCED, max_tokens=60,
        stream=True)
    deltas = [call for chunk in streamed if chunk.choices for call in chunk.choices[0].delta.tool_calls or ()]
    assert deltas[0].function is not None and deltas[0].function.name == "get_weather"
    assert json.loads("".join(d.function.arguments or "" for d in deltas if d.function)) == arguments
    # The agent's next turn: the call it ran and its result, then the engine's answer in words.
    turn: Any = [*ASK_WEATHER,
                 {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                     "name": "get_weather", "arguments": json.dumps(arguments)}}]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}]
    ours, theirs = _both(stack, direct, messages=turn, tools=[WEATHER], max_tokens=24)
    assert ours.choices[0].message.content and ours.choices[0].message.content == theirs.choices[0].message.content


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_json_schema_answer_parses_and_validates(vllm_stacks: dict[str, RunningStack], direct: openai.OpenAI,
                                                   layout: str) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "place", "schema": PLACE, "strict": True}}
    ours, theirs = _both(vllm_stacks[layout], direct, messages=[{"role": "user", "content":
                         "Name the capital of France and its country as JSON."}], response_format=fmt, max_tokens=60)
    answer = json.loads(ours.choices[0].message.content or "")
    jsonschema.validate(answer, PLACE)
    assert answer == json.loads(theirs.choices[0].message.content or "")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_stop_and_logprobs_are_vllms(vllm_stacks: dict[str, RunningStack], direct: openai.OpenAI,
                                     layout: str) -> None:
    ours, theirs = _both(vllm_stacks[layout], direct, messages=[{"role": "user", "content":
                         "List three fruits, one per line."}], stop=["\n"], max_tokens=40, logprobs=True,
                         top_logprobs=2)
    choice = ours.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content
    assert "\n" not in choice.message.content and choice.message.content == theirs.choices[0].message.content
    assert choice.logprobs is not None and choice.logprobs.content
    assert [t.token for t in choice.logprobs.content] == [t.token for t in theirs.choices[0].logprobs.content]
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_image_vllm_cannot_read_is_its_own_400_in_each_clients_shape(vllm_stacks: dict[str, RunningStack],
                                                                        layout: str) -> None:
    stack = vllm_stacks[layout]
    with pytest.raises(openai.BadRequestError) as refused:
        spine_openai(stack).chat.completions.create(model=VLLM_MODEL, max_tokens=8, messages=[{"role": "user",
            "content": [{"type": "text", "text": "What is this?"}, {"type": "image_url",
                                                                   "image_url": {"url": PIXEL}}]}])
    assert refused.value.status_code == 400 and "not a multimodal model" in refused.value.message
    with pytest.raises(anthropic.BadRequestError) as refused_too:
        spine_anthropic(stack).messages.create(model=VLLM_MODEL, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": PIXEL.split(",", 1)[1]}}]}])
    assert refused_too.value.status_code == 400 and "not a multimodal model" in refused_too.value.message


@pytest.mark.parametrize("layout", LAYOUTS)
def test_embeddings_asked_of_a_generative_engine_are_the_clients_400_and_never_eject_it(
        vllm_stacks: dict[str, RunningStack], layout: str) -> None:
    client = spine_openai(vllm_stacks[layout])
    for _ in range(6):  # more than the failures that would eject an upstream at fault
        with pytest.raises(openai.BadRequestError) as refused:
            client.embeddings.create(model=VLLM_MODEL, input="hello")
        assert "does not serve embeddings" in refused.value.message
    answer = client.chat.completions.create(model=VLLM_MODEL, messages=ASK_WEATHER, max_tokens=4, temperature=0)
    assert answer.choices[0].message.content


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_responses_api_plain_and_streamed_over_vllms_chat(vllm_stacks: dict[str, RunningStack],
                                                              direct: openai.OpenAI, layout: str) -> None:
    client = spine_openai(vllm_stacks[layout])
    ask: Any = {"model": VLLM_MODEL, "instructions": "Answer in one short sentence.",
                "input": "What is the capital of France?", "max_output_tokens": 48, "temperature": 0}
    plain = client.responses.create(**ask)
    expected = direct.chat.completions.create(model=SERVED_NAME, max_tokens=48, temperature=0, messages=[
        {"role": "system", "content": ask["instructions"]}, {"role": "user", "content": ask["input"]}])
    assert plain.output_text == expected.choices[0].message.content and "Paris" in plain.output_text
    assert plain.usage is not None and expected.usage is not None
    assert plain.usage.output_tokens == expected.usage.completion_tokens
    events = list(client.responses.create(**ask, stream=True))
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds[-1] == f"response.{plain.status}"
    assert "response.output_text.delta" in kinds and "response.output_text.done" in kinds
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert text == plain.output_text
    tools: Any = [{"type": "function", "name": "get_weather", "parameters": CITY, "strict": True}]
    called = client.responses.create(model=VLLM_MODEL, input="What is the weather in Paris?", tools=tools,
                                     tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                     max_output_tokens=60)
    (call,) = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_anthropic_clients_tools_round_trip_over_vllms_openai_protocol(
        vllm_stacks: dict[str, RunningStack], direct: openai.OpenAI, layout: str) -> None:
    claude = spine_anthropic(vllm_stacks[layout])
    tools: Any = [{"name": "get_weather", "description": "The weather in a city", "input_schema": CITY,
                   "strict": True}]
    ask: Any = {"model": VLLM_MODEL, "max_tokens": 60, "messages": ASK_WEATHER, "tools": tools,
                "tool_choice": {"type": "tool", "name": "get_weather"}, "extra_body": {"temperature": 0}}
    message = claude.messages.create(**ask)
    (use,) = [block for block in message.content if block.type == "tool_use"]
    expected = direct.chat.completions.create(model=SERVED_NAME, messages=ASK_WEATHER, tools=[WEATHER],
                                              tool_choice=FORCED, max_tokens=60, temperature=0)
    assert message.stop_reason == "tool_use" and (use.name, use.input) == _call(expected.choices[0].message)
    with claude.messages.stream(**ask) as stream:
        deltas = [event.delta.type for event in stream if event.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "input_json_delta" in deltas and final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(use.name, use.input)]
    answer = claude.messages.create(model=VLLM_MODEL, max_tokens=24, tools=tools, extra_body={"temperature": 0},
                                    messages=[*ASK_WEATHER, {"role": "assistant", "content": message.content},
                                              {"role": "user", "content": [{"type": "tool_result",
                                                                            "tool_use_id": use.id,
                                                                            "content": "Sunny, 21 C"}]}])
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"
    assert answer.content[0].text
