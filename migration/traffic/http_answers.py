"""Two HTTP answers to the same request, reduced to what the parity gate compares.

Across two gateways (a foreign legacy endpoint and the spine) the bytes of an answer never
match: ids, timestamps, header sets and usage fields differ by construction. What must
match is what the client acts on: the status class (2xx, 4xx, 5xx), the error type when it
failed (`error.type` in both APIs' error bodies and stream error events), and, for a greedy
request (temperature 0, or Anthropic's `top_k: 1`), the generated text — by value where both
sides answered JSON (a structured output's key order and spacing are not a difference) — and
the tool calls, by name and JSON-equal arguments (OpenAI's `tool_calls`, Anthropic's
`tool_use` blocks, whole or streamed as deltas). Both plain JSON
answers and server-sent-event streams of the OpenAI and Anthropic APIs are read; an answer
that cannot be parsed compares by status class alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

# The fields a comparison may name (`spine_shadow_mismatched_total{field}`).
FIELDS = ("status", "error_type", "text", "tool_calls")
# A failure of the side itself, as opposed to a refusal of the client's request: a 5xx, or
# no answer at all (status 0: the connection failed or timed out).
LAYOUT_FAILURE_STATUS = 500


@dataclass(frozen=True)
class Answer:
    status: int  # the HTTP status; 0 when no answer came (connection refused, reset, timed out)
    error_type: str = ""  # `error.type` of an error body or stream error event
    text: str = ""  # the generated text, all choices' or content blocks' joined
    tool_calls: tuple[tuple[str, str], ...] = ()  # (name, arguments as canonical JSON), in order

    @property
    def status_class(self) -> str:
        return "none" if self.status == 0 else f"{self.status // 100}xx"

    @property
    def layout_failure(self) -> bool:
        """The side failed (no answer, or a 5xx): the error-rate gate's business, never parity's."""
        return self.status == 0 or self.status >= LAYOUT_FAILURE_STATUS


def is_greedy(request: Any) -> bool:
    """A request whose answer is determined by the model: temperature 0, or top_k 1."""
    if not isinstance(request, dict):
        return False
    temperature = request.get("temperature")
    top_k = request.get("top_k")
    return (isinstance(temperature, int | float) and temperature == 0) or top_k == 1


def read_answer(status: int, body: bytes, content_type: str = "") -> Answer:
    """An Answer from a status and a whole body, JSON or a server-sent-event stream."""
    if status == 0:
        return Answer(0)
    if "text/event-stream" in content_type or body.lstrip().startswith((b"data:", b"event:")):
        events = _sse_data(body)
        error_type, text = _read_events(events)
        return Answer(status, error_type, text, _streamed_calls(events))
    try:
        data = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        return Answer(status)
    if not isinstance(data, dict):
        return Answer(status)
    return Answer(status, _error_type(data), "".join(_texts(data)), _calls(data))


def differences(primary: Answer, shadow: Answer, greedy: bool, ignore: Iterable[str] = ()) -> tuple[str, ...]:
    """The fields in which two answers differ, causes only: a different status class makes
    the error type and text differ too, and only the status is named."""
    ignored = set(ignore)
    found: list[str] = []
    if primary.status_class != shadow.status_class:
        found.append("status")
    elif primary.error_type != shadow.error_type:
        found.append("error_type")
    elif greedy and primary.status // 100 == 2:
        if not _same_text(primary.text, shadow.text):
            found.append("text")
        if primary.tool_calls != shadow.tool_calls:
            found.append("tool_calls")
    return tuple(field for field in found if field not in ignored)


def _sse_data(body: bytes) -> Sequence[Any]:
    """The JSON payloads of a stream's `data:` lines (`[DONE]` and anything unparsable left out)."""
    events = []
    for line in body.splitlines():
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if not payload or payload == b"[DONE]":
            continue
        try:
            events.append(orjson.loads(payload))
        except orjson.JSONDecodeError:
            continue
    return events


def _read_events(events: Sequence[Any]) -> tuple[str, str]:
    """(error type, text) of an OpenAI or Anthropic stream."""
    error_type = ""
    parts: list[str] = []
    for event in events:
        if not isinstance(event, dict):
            continue
        error_type = error_type or _error_type(event)
        for choice in event.get("choices") or ():
            if isinstance(choice, dict):
                delta = choice.get("delta")
                if isinstance(delta, dict) and isinstance(delta.get("content"), str):
                    parts.append(delta["content"])
                elif isinstance(choice.get("text"), str):
                    parts.append(choice["text"])
        delta = event.get("delta")
        if event.get("type") == "content_block_delta" and isinstance(delta, dict) \
                and isinstance(delta.get("text"), str):
            parts.append(delta["text"])
    return error_type, "".join(parts)


def _error_type(data: dict[str, Any]) -> str:
    error = data.get("error")
    if isinstance(error, dict):
        kind = error.get("type") or error.get("code")
        return str(kind) if kind else "error"
    if isinstance(error, str):  # a body such as {"error": "content_policy_violation", ...}
        return error
    return ""


def _texts(data: dict[str, Any]) -> Iterable[str]:
    for choice in data.get("choices") or ():
        if isinstance(choice, dict):
            message = choice.get("message")
            if isinstance(message, dict) and isinstance(message.get("content"), str):
                yield message["content"]
            elif isinstance(choice.get("text"), str):
                yield choice["text"]
    if data.get("type") == "message":
        for block in data.get("content") or ():
            if isinstance(block, dict) and isinstance(block.get("text"), str):
                yield block["text"]


def _same_text(a: str, b: str) -> bool:
    """Equal text, or JSON of equal value (a structured output)."""
    if a == b:
        return True
    try:
        return bool(orjson.loads(a) == orjson.loads(b)) if a and b else False
    except orjson.JSONDecodeError:
        return False


def _canonical(arguments: Any) -> str:
    """Tool arguments as canonical JSON (a string of JSON is read first); text that is not
    JSON stays as it is."""
    if isinstance(arguments, str):
        try:
            arguments = orjson.loads(arguments) if arguments else {}
        except orjson.JSONDecodeError:
            return str(arguments)
    return orjson.dumps(arguments, option=orjson.OPT_SORT_KEYS).decode()


def _calls(data: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    calls: list[tuple[str, str]] = []
    for choice in data.get("choices") or ():
        message = choice.get("message") if isinstance(choice, dict) else None
        for call in (message or {}).get("tool_calls") or ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                calls.append((str(function.get("name")), _canonical(function.get("arguments"))))
    if data.get("type") == "message":
        for block in data.get("content") or ():
            if isinstance(block, dict) and block.get("type") == "tool_use":
                calls.append((str(block.get("name")), _canonical(block.get("input"))))
    return tuple(calls)


def _streamed_calls(events: Sequence[Any]) -> tuple[tuple[str, str], ...]:
    """The tool calls of an OpenAI stream (deltas by index) or an Anthropic one (tool_use
    blocks and their input_json_delta pieces)."""
    names: dict[tuple[str, int], str] = {}
    pieces: dict[tuple[str, int], list[str]] = {}
    for event in events:
        if not isinstance(event, dict):
            continue
        for choice in event.get("choices") or ():
            delta = choice.get("delta") if isinstance(choice, dict) else None
            for call in (delta or {}).get("tool_calls") or ():
                if not isinstance(call, dict):
                    continue
                key = ("openai", int(call.get("index") or 0))
                function = call.get("function") or {}
                if function.get("name"):
                    names[key] = str(function["name"])
                pieces.setdefault(key, []).append(str(function.get("arguments") or ""))
        block = event.get("content_block")
        if event.get("type") == "content_block_start" and isinstance(block, dict) and block.get("type") == "tool_use":
            key = ("anthropic", int(event.get("index") or 0))
            names[key] = str(block.get("name"))
            pieces[key] = []
        delta = event.get("delta")
        if event.get("type") == "content_block_delta" and isinstance(delta, dict) \
                and delta.get("type") == "input_json_delta":
            pieces.setdefault(("anthropic", int(event.get("index") or 0)), []).append(str(delta.get("partial_json")))
    return tuple((names.get(key, ""), _canonical("".join(pieces.get(key, [])))) for key in sorted(names))
