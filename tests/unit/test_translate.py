"""Translation between an Anthropic client and an OpenAI-protocol engine (and back): tools,
forced calls and their stop reasons, plain and streamed."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.inference.upstream.translate import (
    OpenAIToAnthropicEvents,
    Untranslatable,
    anthropic_to_openai,
    openai_answer_to_anthropic,
    openai_to_anthropic,
)

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def test_an_anthropic_strict_tool_and_forced_choice_reach_the_engine_as_openais() -> None:
    body = {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "Weather?"}],
            "tools": [{"name": "get_weather", "input_schema": SCHEMA, "strict": True}],
            "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}}
    out = anthropic_to_openai(body)
    assert out["tools"] == [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA,
                                                              "strict": True}}]
    assert out["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert out["parallel_tool_calls"] is False


def test_an_openai_strict_tool_reaches_an_anthropic_engine_strict() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "Weather?"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": SCHEMA, "strict": True}}]}
    assert openai_to_anthropic(body)["tools"] == [{"name": "f", "input_schema": SCHEMA, "strict": True}]


def _answer(finish: str, calls: bool) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": None if calls else "hi"}
    if calls:
        message["tool_calls"] = [{"id": "c1", "type": "function",
                                  "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    return {"id": "x", "model": "m", "choices": [{"index": 0, "message": message, "finish_reason": finish}]}


@pytest.mark.parametrize(("finish", "calls", "expected"), [
    ("stop", True, "tool_use"),        # vLLM ends a named (forced) call with "stop"
    ("tool_calls", True, "tool_use"),
    ("stop", False, "end_turn"),
    ("length", True, "max_tokens"),    # cut off mid-call: not a call to run
])
def test_a_turn_ending_in_tool_calls_is_tool_use_for_an_anthropic_client(finish: str, calls: bool,
                                                                          expected: str) -> None:
    answer = openai_answer_to_anthropic(_answer(finish, calls))
    assert answer["stop_reason"] == expected
    if calls:
        assert answer["content"][-1] == {"type": "tool_use", "id": "c1", "name": "get_weather",
                                          "input": {"city": "Paris"}}


def test_a_streamed_forced_call_ends_in_tool_use_with_its_input_as_json_deltas() -> None:
    events = OpenAIToAnthropicEvents()
    chunks = [{"id": "x", "model": "m", "choices": [{"index": 0, "delta": {"tool_calls": [
                  {"index": 0, "id": "c1", "type": "function", "function": {"name": "get_weather"}}]}}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"city"'}}]}}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ': "P"}'}}]}}]},
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
    out = [json.loads(e) for chunk in chunks for e in events.feed(json.dumps(chunk))]
    out += [json.loads(e) for e in events.feed("[DONE]")]
    kinds = [e["type"] for e in out]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-1] == "message_stop"
    assert out[1]["content_block"]["type"] == "tool_use" and out[1]["content_block"]["name"] == "get_weather"
    partial = "".join(e["delta"]["partial_json"] for e in out if e["type"] == "content_block_delta")
    assert json.loads(partial) == {"city": "P"}
    (delta,) = [e for e in out if e["type"] == "message_delta"]
    assert delta["delta"]["stop_reason"] == "tool_use"


def test_a_block_with_no_translation_is_refused_naming_it() -> None:
    body = {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "data": "x"}}]}]}
    with pytest.raises(Untranslatable, match=r"messages\[0\]\.content\[0\]\.type: 'document'"):
        anthropic_to_openai(body)
