"""The Anthropic-compatible API: `POST /v1/messages`.

A Messages request becomes the pipeline's `GenerateRequest` (`system` is the system prompt,
so requests sharing one share its KV); answers, streams and errors take the shapes the
official `anthropic` SDK parses. A stream is the documented event sequence:
`message_start`, `content_block_start`, `ping`, `content_block_delta`…, `content_block_stop`,
`message_delta` (stop reason and usage), `message_stop`; a failure after it began is an
`error` event. `max_tokens` is required, as in the API; `temperature` defaults to 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from runtime.http import fields, request_checks, transcript
from runtime.http.wire import COUNTED_BY, POLICY_VIOLATION, HttpError, bad_request, policy_violation_body
from wire.v1 import generation_pb2

NAME = "anthropic"
OVERLOADED_STATUS = 529
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}
TIERS = {None: 0, "auto": 0, "standard_only": 0}
API = "anthropic.messages"  # GenerateRequest.api of a Messages request (its body travels with it)


@dataclass
class Parsed:
    request: generation_pb2.GenerateRequest
    stream: bool


def parse(body: Any) -> Parsed:
    body = fields.body_object(body)
    request_checks.anthropic_messages(body)
    system = body.get("system")
    system_parts = [] if system is None else [fields.plain_text(system, "system")]
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages: required, a non-empty array of {role, content}")
    turns: list[tuple[str, str]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request(f"messages[{i}]: must be an object with role and content")
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise bad_request(f"messages[{i}].role: must be user or assistant; got {role!r} "
                              "(the system prompt is the top-level `system` field)")
        turns.append((role, fields.plain_text(message.get("content"), f"messages[{i}].content")))
    system_text, prompt = transcript.render(system_parts, turns)
    conversation = [("system", part) for part in system_parts] + turns
    tier = body.get("service_tier")
    if tier not in TIERS:
        raise bad_request(f"service_tier: must be auto or standard_only; got {tier!r}")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise bad_request("metadata: must be an object")
    request = generation_pb2.GenerateRequest(
        model=fields.string(body, "model"), prompt=prompt, system=system_text,
        max_tokens=fields.max_tokens(body, "max_tokens"), temperature=fields.number(body, "temperature", 1.0))
    transcript.attach(request, conversation)
    request.body, request.api = orjson.dumps(body, option=orjson.OPT_SORT_KEYS), API
    return Parsed(request, fields.boolean(body, "stream"))


def _usage(prompt_tokens: int, completion_tokens: int, counted_by: str = "") -> dict[str, Any]:
    """Anthropic's usage; for an upstream model also whose count it is (as OpenAI's)."""
    usage: dict[str, Any] = {"input_tokens": prompt_tokens, "output_tokens": completion_tokens}
    if counted_by:
        usage[COUNTED_BY] = counted_by
    return usage


def answer(parsed: Parsed, response: generation_pb2.GenerateResponse, request_id: str, counted_by: str = "") -> bytes:
    if response.body:  # the engine's own message (tool_use and thinking blocks, its usage)
        data = orjson.loads(response.body)
        data["model"] = response.model
        if not isinstance(data.get("usage"), dict):  # the engine did not count: the spine's count
            data["usage"] = _usage(response.prompt_tokens, response.completion_tokens)
        if counted_by:
            data["usage"][COUNTED_BY] = counted_by
        return orjson.dumps(data)
    return orjson.dumps({
        "id": f"msg_{request_id}", "type": "message", "role": "assistant", "model": response.model,
        "content": [{"type": "text", "text": response.text}],
        "stop_reason": "stop_sequence" if response.stop_sequence else STOP_REASONS.get(response.finish_reason,
                                                                                         "max_tokens"),
        "stop_sequence": response.stop_sequence or None,
        "usage": _usage(response.prompt_tokens, response.completion_tokens, counted_by),
    })


def _event(name: str, data: Mapping[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class Stream:
    """The events of one streamed message."""

    def __init__(self, parsed: Parsed, request_id: str) -> None:
        self.parsed = parsed
        self.id = f"msg_{request_id}"
        self.raw = False  # the engine's own events are relayed (an upstream engine, a request with a body)
        self.stop_sequence = ""  # the stop string that ended the answer (a built-in model's)

    def piece(self, chunk: generation_pb2.GenerateChunk) -> bytes:
        """One chunk of the pipeline's stream as this API's events."""
        self.stop_sequence = chunk.stop_sequence or self.stop_sequence
        if not self.raw:
            return self.chunk(chunk.text)
        out = []
        for data in chunk.events:
            kind = orjson.loads(data).get("type", "message")
            out.append(b"event: " + str(kind).encode() + b"\ndata: " + data + b"\n\n")
        return b"".join(out)

    def start(self, model: str, prompt_tokens: int) -> bytes:
        if self.raw:
            return b""
        message: dict[str, Any] = {"id": self.id, "type": "message", "role": "assistant", "model": model or self.parsed.request.model,
                   "content": [], "stop_reason": None, "stop_sequence": None, "usage": _usage(prompt_tokens, 0)}
        return (_event("message_start", {"type": "message_start", "message": message})
                + _event("content_block_start", {"type": "content_block_start", "index": 0,
                                                 "content_block": {"type": "text", "text": ""}})
                + _event("ping", {"type": "ping"}))

    def chunk(self, text: str) -> bytes:
        if not text:
            return b""
        return _event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                              "delta": {"type": "text_delta", "text": text}})

    def end(self, finish: str, prompt_tokens: int, completion_tokens: int, counted_by: str = "") -> bytes:
        if self.raw:
            return b""  # the engine's message_stop was relayed
        return (_event("content_block_stop", {"type": "content_block_stop", "index": 0})
                + _event("message_delta", {"type": "message_delta",
                                           "delta": {"stop_reason": "stop_sequence" if self.stop_sequence
                                                     else STOP_REASONS.get(finish, "max_tokens"),
                                                     "stop_sequence": self.stop_sequence or None},
                                           "usage": _usage(prompt_tokens, completion_tokens, counted_by)})
                + _event("message_stop", {"type": "message_stop"}))

    def error(self, error: HttpError, request_id: str) -> bytes:
        if error.kind == POLICY_VIOLATION:
            return _event("error", {"type": "error", **policy_violation_body(error, request_id)})
        return _event("error", {"type": "error", "error": {"type": _kind(error), "message": error.message}})


def _kind(error: HttpError) -> str:
    if error.status == 413:
        return "request_too_large"
    return "rate_limit_error" if error.kind == "insufficient_quota" else error.kind  # Anthropic's only 429 type


def error_body(error: HttpError, request_id: str) -> bytes:
    if error.kind == POLICY_VIOLATION:
        return orjson.dumps(policy_violation_body(error, request_id))
    return orjson.dumps({"type": "error", "error": {"type": _kind(error), "message": error.message},
                         "request_id": request_id})
