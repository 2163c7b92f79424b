"""The parity comparison reads tool calls by name and JSON-equal arguments, and JSON text by value."""

from __future__ import annotations

from typing import Any

import orjson

from migration.traffic.http_answers import differences, read_answer


def _chat(content: str | None = None, calls: list[tuple[str, str]] | None = None) -> bytes:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
                                 for i, (n, a) in enumerate(calls)]
    return orjson.dumps({"id": "x", "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}]})


def _stream(name: str, pieces: list[str]) -> bytes:
    events = [{"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "c", "type": "function", "function": {"name": name, "arguments": ""}}]}}]}]
    events += [{"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": p}}]}}]}
               for p in pieces]
    return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def test_equal_arguments_in_another_spelling_are_the_same_call() -> None:
    a = read_answer(200, _chat(calls=[("weather", '{"city": "Paris", "unit": "C"}')]))
    b = read_answer(200, _chat(calls=[("weather", '{"unit":"C","city":"Paris"}')]))
    assert differences(a, b, greedy=True) == ()


def test_another_tool_name_or_arguments_is_a_mismatch() -> None:
    a = read_answer(200, _chat(calls=[("weather", '{"city": "Paris"}')]))
    assert differences(a, read_answer(200, _chat(calls=[("forecast", '{"city": "Paris"}')])), True) == ("tool_calls",)
    assert differences(a, read_answer(200, _chat(calls=[("weather", '{"city": "Rome"}')])), True) == ("tool_calls",)


def test_a_streamed_call_compares_with_a_whole_one() -> None:
    whole = read_answer(200, _chat(calls=[("weather", '{"city": "Paris"}')]))
    streamed = read_answer(200, _stream("weather", ['{"city"', ': "Paris"}']), "text/event-stream")
    assert streamed.tool_calls == whole.tool_calls and differences(whole, streamed, True) == ()
    claude = b"".join(b"event: x\ndata: " + orjson.dumps(e) + b"\n\n" for e in [
        {"type": "content_block_start", "index": 0, "content_block": {"type": "tool_use", "name": "weather"}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "input_json_delta", "partial_json": '{"city":'}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "input_json_delta", "partial_json": '"Paris"}'}}])
    assert read_answer(200, claude, "text/event-stream").tool_calls == whole.tool_calls


def test_json_answers_compare_by_value() -> None:
    a = read_answer(200, _chat('{"a": 1, "b": [1, 2]}'))
    assert differences(a, read_answer(200, _chat('{"b":[1,2],"a":1}')), True) == ()
    assert differences(a, read_answer(200, _chat('{"b":[2,1],"a":1}')), True) == ("text",)
