"""The two wire shapes an upstream may speak: OpenAI's chat completions and Anthropic's Messages.

Pure functions, no I/O: a `GenerateRequest` becomes the upstream's request body; its answer,
its stream's events and its error bodies become the spine's `Answer`, `Delta`s and a message.
Anything that does not have the documented shape is `Malformed` (a fault of the upstream,
never passed on as text).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from services.inference.upstream import translate
from wire.v1 import generation_pb2

ANTHROPIC_VERSION = "2023-06-01"
# What servers say when a prompt is longer than the model's context: OpenAI's error code,
# vLLM's and llama.cpp's messages, Anthropic's, the spine's own.
_CONTEXT_LENGTH = re.compile(r"context_length_exceeded|context length|maximum context|context window|"
                             r"prompt is too long|exceeds the model's context|exceed_context_size", re.IGNORECASE)


class Malformed(ValueError):
    """The upstream's answer is not what its protocol documents."""


@dataclass(slots=True)
class Answer:
    text: str
    finish: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of the prompt's, read from the upstream's prompt cache
    body: bytes = b""  # the engine's answer in the client's API (a request with a body)


@dataclass(slots=True)
class Delta:
    """One piece of a stream: text, and at its end the finish reason and the usage where the
    upstream sent them (0: not sent)."""

    text: str = ""
    finish: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    end: bool = False
    events: list[bytes] = field(default_factory=list)  # the engine's events in the client's API


Relay = Callable[[str, str], list[bytes]]  # one event (name, data) → the client's events


def whole_body(request: generation_pb2.GenerateRequest, protocol: str, model: str, stream: bool) -> bytes | None:
    """The client's whole request for an engine speaking `protocol` (None: the request has
    no body, so the engine is sent its plain reading)."""
    if not request.api or not request.body:
        return None
    return orjson.dumps(translate.request_body(request.api, request.body, protocol, model, stream))


def _stop_sequences(request: generation_pb2.GenerateRequest) -> Any:
    try:
        body = orjson.loads(request.body)
    except orjson.JSONDecodeError:
        return None
    stop = body.get("stop_sequences") if isinstance(body, dict) else None
    return stop if isinstance(stop, list) else None


class StreamError(Exception):
    """The upstream reported an error inside its stream (an `error` event)."""


def _finish(reason: Any) -> str:
    return "length" if reason in ("length", "max_tokens") else "stop"


def _count(usage: Any, key: str) -> int:
    value = usage.get(key) if isinstance(usage, dict) else None
    return value if isinstance(value, int) and value >= 0 else 0


def _openai_cached(usage: Any) -> int:
    """OpenAI's `usage.prompt_tokens_details.cached_tokens` (prompt tokens read from its cache)."""
    return _count(usage.get("prompt_tokens_details") if isinstance(usage, dict) else None, "cached_tokens")


def _anthropic_prompt(usage: Any) -> tuple[int, int]:
    """(prompt tokens, of which cached) from Anthropic's usage, whose `input_tokens` counts only
    what was neither read from nor written to its prompt cache."""
    cached = _count(usage, "cache_read_input_tokens")
    return _count(usage, "input_tokens") + cached + _count(usage, "cache_creation_input_tokens"), cached


def loads(raw: bytes | str, what: str) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        shown = raw[:80] if isinstance(raw, str) else raw[:80].decode("utf-8", "replace")
        raise Malformed(f"{what} is not JSON ({error}): {shown!r}") from None


def _conversation(request: generation_pb2.GenerateRequest) -> list[tuple[str, str]]:
    """(role, text) of the request as a chat: its messages, else its system prompt and prompt."""
    if request.messages:
        return [(m.role, m.content) for m in request.messages]
    turns = [("system", request.system)] if request.system else []
    return [*turns, ("user", request.prompt)]


def conversation_text(request: generation_pb2.GenerateRequest) -> str:
    """Every turn's text of the request, as the upstream is sent it (what a prompt's tokens
    are estimated from when the upstream does not count them)."""
    return "\n".join(text for _, text in _conversation(request))


def error_message(raw: bytes) -> str:
    """A person-readable message from an error body of either API (or its first bytes)."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw[:200].decode("utf-8", "replace").strip() or "(empty body)"
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        code = error.get("code") or error.get("type")
        return f"{error['message']}" + (f" ({code})" if isinstance(code, str) and code not in error["message"] else "")
    if isinstance(error, str):
        return error
    return raw[:200].decode("utf-8", "replace")


def is_context_length(message: str) -> bool:
    return bool(_CONTEXT_LENGTH.search(message))


def _embeddings(data: Any, raw: bytes) -> Answer:
    """An engine's embeddings answer: passed on whole; its usage counts the input."""
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise Malformed("the upstream's embeddings answer has no data array")
    usage = data.get("usage") or {}
    return Answer("", "stop", _count(usage, "prompt_tokens"), 0, body=raw)


class OpenAIChat:
    """`POST {base_url}/chat/completions` (vLLM, TGI, SGLang, llama.cpp, LiteLLM, OpenAI, the spine)."""

    name = "openai"
    path = "/chat/completions"

    @staticmethod
    def headers(key: str | None) -> dict[str, str]:
        return {"authorization": f"Bearer {key}"} if key else {}

    @staticmethod
    def body(request: generation_pb2.GenerateRequest, model: str, stream: bool) -> bytes:
        whole = whole_body(request, "openai", model, stream)
        if whole is not None:
            return whole
        body: dict[str, Any] = {"model": model, "max_tokens": request.max_tokens,
                                "temperature": request.temperature,
                                "messages": [{"role": role, "content": text} for role, text in _conversation(request)]}
        if request.HasField("seed"):
            body["seed"] = request.seed
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return orjson.dumps(body)

    @staticmethod
    def answer(raw: bytes, request: generation_pb2.GenerateRequest | None = None) -> Answer:
        data = loads(raw, "the upstream's answer")
        if request is not None and request.api == translate.EMBEDDINGS:
            return _embeddings(data, raw)
        try:
            choice = data["choices"][0]
            text = choice["message"]["content"] or ""
            if not isinstance(text, str):
                raise TypeError("content is not text")
            usage = data.get("usage") or {}
            answer = Answer(text, _finish(choice.get("finish_reason")), _count(usage, "prompt_tokens"),
                            _count(usage, "completion_tokens"), _openai_cached(usage))
        except (KeyError, IndexError, TypeError, AttributeError) as error:
            raise Malformed(f"the upstream's answer has no choices[0].message.content ({error})") from None
        if request is not None and request.api == translate.OPENAI and request.body:
            answer.body = raw
        elif request is not None and request.api == translate.ANTHROPIC and request.body:
            answer.body = orjson.dumps(translate.openai_answer_to_anthropic(data, _stop_sequences(request)))
        return answer

    @staticmethod
    def relay(api: str) -> Relay | None:
        """How each event becomes the client's (None: a request without a body)."""
        if api == translate.OPENAI:
            return lambda name, data: [] if data == "[DONE]" else [data.encode()]
        if api == translate.ANTHROPIC:
            events = translate.OpenAIToAnthropicEvents()
            return lambda name, data: events.feed(data)
        return None

    @staticmethod
    def event(name: str, data: str) -> Delta | None:
        """One server-sent event: a Delta, or None for one that carries nothing."""
        if data == "[DONE]":
            return Delta(end=True)
        event = loads(data, "a stream event")
        if not isinstance(event, dict):
            raise Malformed(f"a stream event is not an object: {data[:80]!r}")
        if "error" in event:
            raise StreamError(error_message(data.encode()))
        usage = event.get("usage")
        choices = event.get("choices")
        if not isinstance(choices, list):
            raise Malformed(f"a stream event has no choices: {data[:80]!r}")
        delta = Delta(prompt_tokens=_count(usage, "prompt_tokens"), completion_tokens=_count(usage, "completion_tokens"),
                      cached_tokens=_openai_cached(usage))
        if choices:
            choice = choices[0]
            piece = (choice.get("delta") or {}).get("content") if isinstance(choice, dict) else None
            if piece is not None and not isinstance(piece, str):
                raise Malformed(f"a stream event's delta is not text: {data[:80]!r}")
            delta.text = piece or ""
            if choice.get("finish_reason"):
                delta.finish = _finish(choice["finish_reason"])
        return delta


class AnthropicMessages:
    """`POST {base_url}/messages` (Anthropic's API, or a gateway speaking it)."""

    name = "anthropic"
    path = "/messages"

    @staticmethod
    def headers(key: str | None) -> dict[str, str]:
        out = {"anthropic-version": ANTHROPIC_VERSION}
        if key:
            out["x-api-key"] = key
        return out

    @staticmethod
    def body(request: generation_pb2.GenerateRequest, model: str, stream: bool) -> bytes:
        whole = whole_body(request, "anthropic", model, stream)
        if whole is not None:
            return whole
        turns = _conversation(request)
        system = "\n\n".join(text for role, text in turns if role == "system")
        # Anthropic's temperature runs 0..1 (the spine's, OpenAI's, 0..2): the nearest it takes.
        body: dict[str, Any] = {"model": model, "max_tokens": request.max_tokens,
                                "temperature": min(request.temperature, 1.0),
                                "messages": [{"role": role, "content": text} for role, text in turns
                                             if role != "system"]}
        if system:
            body["system"] = system
        if stream:
            body["stream"] = True
        return orjson.dumps(body)

    @staticmethod
    def answer(raw: bytes, request: generation_pb2.GenerateRequest | None = None) -> Answer:
        data = loads(raw, "the upstream's answer")
        try:
            blocks = data["content"]
            text = "".join(block["text"] for block in blocks if block.get("type") == "text")
            usage = data.get("usage") or {}
            prompt, cached = _anthropic_prompt(usage)
            answer = Answer(text, _finish(data.get("stop_reason")), prompt, _count(usage, "output_tokens"), cached)
        except (KeyError, TypeError, AttributeError) as error:
            raise Malformed(f"the upstream's answer has no text content blocks ({error})") from None
        if request is not None and request.api == translate.ANTHROPIC and request.body:
            answer.body = raw
        elif request is not None and request.api == translate.OPENAI and request.body:
            answer.body = orjson.dumps(translate.anthropic_answer_to_openai(data))
        return answer

    @staticmethod
    def relay(api: str) -> Relay | None:
        """How each event becomes the client's (None: a request without a body)."""
        if api == translate.ANTHROPIC:
            return lambda name, data: [data.encode()]
        if api == translate.OPENAI:
            events = translate.AnthropicToOpenAIEvents()
            return lambda name, data: events.feed(orjson.loads(data)) if name != "ping" else []
        return None

    @staticmethod
    def event(name: str, data: str) -> Delta | None:
        if name == "ping":
            return None
        event = loads(data, "a stream event")
        if not isinstance(event, dict):
            raise Malformed(f"a stream event is not an object: {data[:80]!r}")
        kind = event.get("type", name)
        try:
            if kind == "error":
                raise StreamError(error_message(data.encode()))
            if kind == "message_start":
                prompt, cached = _anthropic_prompt(event["message"].get("usage"))
                return Delta(prompt_tokens=prompt, cached_tokens=cached)
            if kind == "content_block_delta":
                delta = event["delta"]
                text = delta.get("text", "") if delta.get("type") == "text_delta" else ""
                if not isinstance(text, str):
                    raise TypeError("text is not text")
                return Delta(text=text)
            if kind == "message_delta":
                return Delta(finish=_finish(event["delta"].get("stop_reason")),
                             completion_tokens=_count(event.get("usage"), "output_tokens"))
            if kind == "message_stop":
                return Delta(end=True)
        except (KeyError, TypeError, AttributeError) as error:
            raise Malformed(f"a {kind} event lacks a field ({error}): {data[:80]!r}") from None
        return None  # content_block_start/stop and events added later


PROTOCOLS: dict[str, type[OpenAIChat] | type[AnthropicMessages]] = {
    OpenAIChat.name: OpenAIChat, AnthropicMessages.name: AnthropicMessages}
