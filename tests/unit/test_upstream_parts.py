"""The upstream client's pure parts: the retry budget, the two wire shapes, the SSE parser."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from services.inference.upstream.failures import Kind, kind_for_status, retry_after_s
from services.inference.upstream.protocols import (
    AnthropicMessages,
    Malformed,
    OpenAIChat,
    StreamError,
    error_message,
    is_context_length,
)
from services.inference.upstream.retry_budget import RetryBudget
from services.inference.upstream.transports import NoEvents, SSEParser
from wire.v1 import generation_pb2


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_retries_stay_a_share_of_requests_within_the_window() -> None:
    clock = Clock()
    budget = RetryBudget(ratio=0.2, min_per_s=0.0, window_s=10, clock=clock)
    for _ in range(10):
        budget.request()
    assert [budget.try_retry() for _ in range(3)] == [True, True, False]  # 20% of 10
    clock.now += 11  # the window moved past them: no requests, no retries
    assert not budget.try_retry() and budget.refused == 2
    floor = RetryBudget(ratio=0.0, min_per_s=0.5, window_s=10, clock=clock)
    assert sum(floor.try_retry() for _ in range(10)) == 5  # a quiet upstream: min_per_s x window


def test_openai_bodies_answers_and_stream_events() -> None:
    request = generation_pb2.GenerateRequest(model="m", prompt="hi", system="be brief", max_tokens=5, temperature=0.5,
                                             seed=3)
    body = orjson.loads(OpenAIChat.body(request, "remote", stream=True))
    assert body["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert body["model"] == "remote" and body["seed"] == 3 and body["stream_options"] == {"include_usage": True}
    answer = OpenAIChat.answer(orjson.dumps({"choices": [{"message": {"content": "ok"}, "finish_reason": "length"}],
                                             "usage": {"prompt_tokens": 4, "completion_tokens": 5}}))
    assert (answer.text, answer.finish, answer.prompt_tokens, answer.completion_tokens) == ("ok", "length", 4, 5)
    piece = OpenAIChat.event("message", '{"choices": [{"delta": {"content": "a"}, "finish_reason": null}]}')
    assert piece is not None and piece.text == "a" and not piece.end
    ended = OpenAIChat.event("message", "[DONE]")
    assert ended is not None and ended.end
    with pytest.raises(Malformed):
        OpenAIChat.answer(b'{"choices": []}')
    with pytest.raises(StreamError, match="overloaded"):
        OpenAIChat.event("message", '{"error": {"message": "overloaded", "type": "server_error"}}')


def test_anthropic_bodies_and_stream_events() -> None:
    request = generation_pb2.GenerateRequest(model="m", prompt="hi", system="sys", max_tokens=5, temperature=1.7)
    body = orjson.loads(AnthropicMessages.body(request, "claude", stream=False))
    assert body["system"] == "sys" and body["messages"] == [{"role": "user", "content": "hi"}]
    assert body["temperature"] == 1.0  # its range is 0..1
    start = AnthropicMessages.event("message_start", '{"type": "message_start", "message": {"usage": '
                                                     '{"input_tokens": 7}}}')
    delta = AnthropicMessages.event("content_block_delta", '{"type": "content_block_delta", "delta": '
                                                           '{"type": "text_delta", "text": "x"}}')
    end = AnthropicMessages.event("message_delta", '{"type": "message_delta", "delta": {"stop_reason": "end_turn"}, '
                                                   '"usage": {"output_tokens": 2}}')
    assert start is not None and start.prompt_tokens == 7
    assert delta is not None and delta.text == "x"
    assert end is not None and (end.finish, end.completion_tokens) == ("stop", 2)
    assert AnthropicMessages.event("ping", "{}") is None


def test_error_kinds_and_their_reading() -> None:
    assert kind_for_status(429, "", False) == Kind.OVERLOADED and kind_for_status(502, "", False) == Kind.FAILED
    assert kind_for_status(401, "", False) == Kind.MISCONFIGURED
    message = error_message(b'{"error": {"message": "This model\'s maximum context length is 8 tokens", '
                            b'"code": "context_length_exceeded"}}')
    assert is_context_length(message) and kind_for_status(400, message, True) == Kind.CONTEXT
    assert kind_for_status(400, "bad temperature", False) == Kind.REFUSED
    assert retry_after_s("2.5") == 2.5 and retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT") == 1.0
    assert retry_after_s(None) is None


def test_sse_events_across_pieces_and_line_endings() -> None:
    parser = SSEParser(max_bytes=64)
    assert parser.feed(b"data: {\"a\"") == []
    assert parser.feed(b": 1}\r\n\r\nevent: ping\rdata: x\r") == [("message", '{"a": 1}')]
    assert parser.feed(b"\n: a comment\n\n") == [("ping", "x")]
    with pytest.raises(ValueError, match="over 64 bytes"):
        parser.feed(b"data: " + b"y" * 100)


def test_sse_events_read_byte_by_byte_match_those_read_at_once() -> None:
    """The parser keeps its place between pieces: a stream cut at every byte reads the same."""
    stream = (b"event: a\r\ndata: 1\r\ndata: 2\r\n\r\n: c\n\ndata: \xc3\xa9\r\r"
              b"data: {\"x\": 3}\n\nevent: b\ndata: tail\n\n")
    whole = SSEParser(max_bytes=1024).feed(stream)
    parser = SSEParser(max_bytes=1024)
    assert [event for i in range(len(stream)) for event in parser.feed(stream[i:i + 1])] == whole
    assert whole == [("a", "1\n2"), ("message", "é"), ("message", '{"x": 3}'), ("b", "tail")]


def test_a_stream_of_blank_lines_is_cut_off_after_its_bound() -> None:
    parser = SSEParser(max_bytes=1024, max_idle_bytes=2048)
    assert parser.feed(b"\n" * 2000) == []
    with pytest.raises(NoEvents, match="without an event"):
        parser.feed(b"\r\n" * 100)
    comments = SSEParser(max_bytes=1024, max_idle_bytes=2048)
    for _ in range(100):  # keep-alive comments between events are fine: each event resets the count
        assert comments.feed(b": keep-alive\n\n" * 10 + b"data: x\n\n") == [("message", "x")]


def test_a_tokenizer_file_that_cannot_be_read_is_a_config_error(tmp_path: Path) -> None:
    from services.common import ConfigError
    from services.inference.upstream.token_count import TokenCounter

    (tmp_path / "tokenizer.json").write_text("{not a tokenizer")
    with pytest.raises(ConfigError, match=r"upstream of 'x'\.tokenizer_file: cannot read .*tokenizer\.json"):
        TokenCounter(tmp_path / "tokenizer.json", "upstream of 'x'")
    estimate = TokenCounter(None, "upstream of 'x'")
    assert estimate.name == "estimate" and estimate.count("12345") == 2 and estimate.count("") == 0
