"""The OpenAI-compatible API: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`.

Requests become the pipeline's `GenerateRequest`; answers, server-sent-event streams and
errors take the shapes the official `openai` SDK parses (chat completion and its chunks,
text completion, `{"error": {...}}`). Defaults are the API's: `temperature` 1, and
`max_tokens` (or `max_completion_tokens`) the server's limit for a chat, 16 for a text
completion. `service_tier` picks the request's priority (`priority` 1, `flex` -1).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from runtime.http import fields, request_checks, transcript
from runtime.http.wire import COUNTED_BY, POLICY_VIOLATION, HttpError, bad_request, policy_violation_body
from wire.v1 import generation_pb2

NAME = "openai"
OVERLOADED_STATUS = 503
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
API = "openai.chat"  # GenerateRequest.api of a chat request (its body travels with it)
TIERS = {None: 0, "auto": 0, "default": 0, "priority": 1, "flex": -1}
# /v1/completions fields no model is sent (a chat's fields travel in its body, and a built-in
# model refuses those it cannot honour: `services.inference.request_body`).
UNSUPPORTED = ("suffix", "echo", "best_of", "logprobs", "stop", "logit_bias")
COMPLETION_DEFAULT_MAX_TOKENS = 16  # the API's own default for /v1/completions


EMBEDDINGS_API = "openai.embeddings"  # GenerateRequest.api of POST /v1/embeddings


@dataclass
class Parsed:
    request: generation_pb2.GenerateRequest
    stream: bool
    include_usage: bool
    chat: bool  # /v1/chat/completions (else /v1/completions)
    embeddings: bool = False  # /v1/embeddings


def _common(body: Mapping[str, Any], max_tokens: int, system: str, prompt: str) -> generation_pb2.GenerateRequest:
    fields.integer(body, "n", None, low=1, high=128)
    tier = body.get("service_tier")
    if tier not in TIERS:
        raise bad_request(f"service_tier: must be one of auto, default, priority, flex; got {tier!r}")
    seed = fields.integer(body, "seed", None)
    request = generation_pb2.GenerateRequest(
        model=fields.string(body, "model"), prompt=prompt, system=system, max_tokens=max_tokens,
        temperature=fields.number(body, "temperature", 1.0), priority=TIERS[tier])
    if seed is not None:
        request.seed = seed
    return request


def parse_chat(body: Any, default_max_tokens: int) -> Parsed:
    body = fields.body_object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages: required, a non-empty array of {role, content}")
    request_checks.openai_chat(body)
    system_parts: list[str] = []
    turns: list[tuple[str, str]] = []
    conversation: list[tuple[str, str]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request(f"messages[{i}]: must be an object with role and content")
        role = message.get("role")
        if role not in ROLES:
            raise bad_request(f"messages[{i}].role: must be one of {', '.join(ROLES)}; got {role!r}")
        text = fields.plain_text(message.get("content"), f"messages[{i}].content")
        if role in ("system", "developer"):
            system_parts.append(text)
            conversation.append(("system", text))
        elif role in ("tool", "function"):  # a tool's result: the plain reading hears it as the user's
            turns.append(("user", text))
            conversation.append(("user", text))
        else:
            turns.append((role, text))
            conversation.append((role, text))
    system, prompt = transcript.render(system_parts, turns)
    tokens = fields.max_tokens(body, "max_completion_tokens", None)
    if tokens is None:
        tokens = fields.max_tokens(body, "max_tokens", default_max_tokens)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("stream_options: must be an object")
    include_usage = fields.boolean(options or {}, "include_usage")
    request = _common(body, tokens, system, prompt)
    transcript.attach(request, conversation)
    request.body, request.api = orjson.dumps(body, option=orjson.OPT_SORT_KEYS), API
    return Parsed(request, fields.boolean(body, "stream"), include_usage, chat=True)


def parse_embeddings(body: Any) -> Parsed:
    """`POST /v1/embeddings`: `input` a string, a list of strings, or token arrays. The body goes
    to the engine as sent (dimensions, encoding_format, user…); the pipeline reads the input's
    text (what limits, the cache key and logs see). Never streamed; always cacheable (an
    embedding does not sample)."""
    body = fields.body_object(body)
    given = body.get("input")
    items = [given] if isinstance(given, str) else given
    if not isinstance(items, list) or not items:
        raise bad_request("input: required, a string or a non-empty array of strings or token arrays")
    texts: list[str] = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            texts.append(item)
        elif isinstance(item, int) and not isinstance(item, bool):
            texts.append(str(item))  # one array of tokens
        elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            texts.append(" ".join(map(str, item)))
        else:
            raise bad_request(f"input[{i}]: must be a string or an array of token ids")
    encoding = body.get("encoding_format")
    if encoding not in (None, "float", "base64"):
        raise bad_request(f"encoding_format: must be float or base64, got {encoding!r}")
    request = generation_pb2.GenerateRequest(model=fields.string(body, "model"), prompt="\n".join(texts) or " ",
                                             max_tokens=1, temperature=0.0)
    request.body, request.api = orjson.dumps(body, option=orjson.OPT_SORT_KEYS), EMBEDDINGS_API
    return Parsed(request, False, False, chat=False, embeddings=True)


def parse_completion(body: Any, default_max_tokens: int) -> Parsed:
    body = fields.body_object(body)
    fields.refuse_unsupported(body, UNSUPPORTED)
    n = fields.integer(body, "n", None)
    if n not in (None, 1):
        raise bad_request(f"n: only 1 choice per request is supported on /v1/completions, got {n}")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad_request("prompt: must be a string (or an array of one string)")
    tokens = fields.max_tokens(body, "max_tokens", min(COMPLETION_DEFAULT_MAX_TOKENS, default_max_tokens))
    options = body.get("stream_options")
    include_usage = fields.boolean(options if isinstance(options, dict) else {}, "include_usage")
    return Parsed(_common(body, tokens, "", prompt), fields.boolean(body, "stream"), include_usage, chat=False)


def _usage(prompt_tokens: int, completion_tokens: int, counted_by: str = "") -> dict[str, Any]:
    """OpenAI's usage; for an upstream model also whose count it is (`spine_counted_by`:
    `upstream` or `estimate`, an extra field the SDKs keep as it is)."""
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens}
    if counted_by:
        usage[COUNTED_BY] = counted_by
    return usage


def _engine_answer(response: generation_pb2.GenerateResponse, counted_by: str) -> bytes:
    """The engine's own answer, as it sent it (tool calls, refusal, logprobs, choices, usage
    details), with the spine's name for the model and whose count its usage is."""
    data = orjson.loads(response.body)
    data["model"] = response.model
    if not isinstance(data.get("usage"), dict):  # the engine did not count: the spine's count, saying so
        data["usage"] = _usage(response.prompt_tokens, response.completion_tokens)
    if counted_by:
        data["usage"][COUNTED_BY] = counted_by
    return orjson.dumps(data)


def answer(parsed: Parsed, response: generation_pb2.GenerateResponse, request_id: str, counted_by: str = "") -> bytes:
    if parsed.embeddings:  # the engine's vectors as it sent them
        return _engine_answer(response, counted_by)
    if parsed.chat and response.body:
        return _engine_answer(response, counted_by)
    finish = response.finish_reason or "length"
    common = {"created": int(time.time()), "model": response.model,
              "usage": _usage(response.prompt_tokens, response.completion_tokens, counted_by)}
    if response.system_digest:
        common["system_fingerprint"] = response.system_digest
    if parsed.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": response.text, "refusal": None},
                  "logprobs": None, "finish_reason": finish}
        return orjson.dumps({"id": f"chatcmpl-{request_id}", "object": "chat.completion", **common,
                             "choices": [choice]})
    choice = {"index": 0, "text": response.text, "logprobs": None, "finish_reason": finish}
    return orjson.dumps({"id": f"cmpl-{request_id}", "object": "text_completion", **common, "choices": [choice]})


class Stream:
    """The server-sent events of one streamed answer (`data: {...}` lines, then `data: [DONE]`)."""

    def __init__(self, parsed: Parsed, request_id: str) -> None:
        self.parsed = parsed
        self.id = f"{'chatcmpl' if parsed.chat else 'cmpl'}-{request_id}"
        self.object = "chat.completion.chunk" if parsed.chat else "text_completion"
        self.created = int(time.time())
        self.model = parsed.request.model
        self.raw = False  # the engine's own events are relayed (an upstream engine, a request with a body)
        self.usage_sent = False

    def piece(self, chunk: generation_pb2.GenerateChunk) -> bytes:
        """One chunk of the pipeline's stream as this API's events."""
        if not self.raw:
            return self.chunk(chunk.text)
        out = []
        for event in chunk.events:
            if not self.parsed.include_usage and event.startswith(b'{') and b'"usage"' in event:
                data = orjson.loads(event)
                if not data.get("choices"):  # the usage the spine asked for itself: not shown
                    continue
                data.pop("usage", None)
                event = orjson.dumps(data)
            elif b'"usage"' in event:
                self.usage_sent = self.usage_sent or bool(orjson.loads(event).get("usage"))
            out.append(b"data: " + event + b"\n\n")
        return b"".join(out)

    def _event(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        data = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, **extra}
        return b"data: " + orjson.dumps(data) + b"\n\n"

    def _choice(self, text: str | None, finish: str | None) -> dict[str, Any]:
        if self.parsed.chat:
            delta: dict[str, Any] = {} if text is None else {"content": text}
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

    def start(self, model: str, prompt_tokens: int) -> bytes:
        self.model = model or self.model
        if not self.parsed.chat or self.raw:
            return b""
        return self._event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])

    def chunk(self, text: str) -> bytes:
        return self._event([self._choice(text, None)]) if text else b""

    def end(self, finish: str, prompt_tokens: int, completion_tokens: int, counted_by: str = "") -> bytes:
        if self.raw:
            counted = b""
            if self.parsed.include_usage and not self.usage_sent:  # the engine did not count: the spine's count
                counted = self._event([], usage=_usage(prompt_tokens, completion_tokens, counted_by))
            return counted + b"data: [DONE]\n\n"
        out = self._event([self._choice(None, finish or "length")])
        if self.parsed.include_usage:
            out += self._event([], usage=_usage(prompt_tokens, completion_tokens, counted_by))
        return out + b"data: [DONE]\n\n"

    def error(self, error: HttpError, request_id: str) -> bytes:
        return b"data: " + error_body(error, request_id) + b"\n\n"  # the stream ends here, without [DONE]


_CODES = {401: "invalid_api_key", 404: "model_not_found", 429: "rate_limit_exceeded", 503: "overloaded",
          413: "request_too_large", 504: "timeout"}


def error_body(error: HttpError, request_id: str) -> bytes:
    if error.kind == POLICY_VIOLATION:
        return orjson.dumps(policy_violation_body(error, request_id))
    kind = {"authentication_error": "invalid_request_error", "overloaded_error": "server_error",
            "api_error": "server_error", "not_found_error": "invalid_request_error"}.get(error.kind, error.kind)
    code = kind if kind == "insufficient_quota" else _CODES.get(error.status)
    return orjson.dumps({"error": {"message": error.message, "type": kind, "param": None,
                                   "code": code}, "request_id": request_id})
