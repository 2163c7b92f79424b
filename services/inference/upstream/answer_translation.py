"""An engine's answer in the client's API: OpenAI chat answers and chunks as Anthropic
Messages answers and events, and back; the engine's own events passed on as they came.

Used when a client's API is not the engine's protocol (the request was translated by
`request_translation`). Text, reasoning, tool calls, stop reasons and usage are re-shaped,
streams event by event. Apart from the requests' translation because nothing here is refused:
an answer is what the engine said, only in the client's words.
"""

from __future__ import annotations

from typing import Any

import orjson

from services.inference.upstream.request_translation import tool_arguments

_FINISH_TO_ANTHROPIC = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                        "function_call": "tool_use", "content_filter": "refusal"}
_STOP_TO_OPENAI = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls",
                   "refusal": "content_filter", "pause_turn": "stop"}


# -- OpenAI engine → Anthropic client ------------------------------------------------------------
def openai_answer_to_anthropic(data: dict[str, Any], stop_sequences: Any = None) -> dict[str, Any]:
    choice = (data.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        content.append({"type": "tool_use", "id": call.get("id"), "name": function.get("name"),
                        "input": tool_arguments(function.get("arguments"))})
    stop_reason = _stop_reason(choice.get("finish_reason"), bool(message.get("tool_calls")))
    matched = choice.get("stop_reason")  # vLLM names the stop string it met
    stop_sequence = matched if isinstance(matched, str) and matched in (stop_sequences or ()) else None
    if stop_sequence is not None:
        stop_reason = "stop_sequence"
    return {"id": data.get("id"), "type": "message", "role": "assistant", "model": data.get("model"),
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": usage_to_anthropic(data.get("usage"))}


def _stop_reason(finish: Any, called: bool) -> str:
    """Anthropic's stop reason for an OpenAI finish reason. A turn that ended with tool calls is
    `tool_use` whatever the engine's finish says: vLLM ends a forced (named) call with `stop`,
    and an Anthropic client runs its tools only on `tool_use`."""
    if called and finish in ("stop", "tool_calls", "function_call"):
        return "tool_use"
    return _FINISH_TO_ANTHROPIC.get(finish, "end_turn")


def usage_to_anthropic(usage: Any) -> dict[str, int]:
    usage = usage if isinstance(usage, dict) else {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": max(0, (usage.get("prompt_tokens") or 0) - cached), "cache_read_input_tokens": cached,
            "output_tokens": usage.get("completion_tokens") or 0}


class OpenAIToAnthropicEvents:
    """An OpenAI engine's chat chunks as an Anthropic client's Messages events."""

    def __init__(self, request_id: str = "msg_spine") -> None:
        self.id = request_id
        self.started = False
        self.block = -1  # the open content block's index (-1: none)
        self.block_kind = ""
        self.tools: dict[int, int] = {}  # the engine's tool_call index → its block's index
        self.stop_reason = "end_turn"
        self.usage: dict[str, int] = {"input_tokens": 0, "output_tokens": 0}

    def feed(self, data: str) -> list[bytes]:
        if data == "[DONE]":
            return [*self._close(), _json({"type": "message_delta", "delta": {"stop_reason": self.stop_reason,
                                                                              "stop_sequence": None},
                                            "usage": self.usage}), _json({"type": "message_stop"})]
        chunk = orjson.loads(data)
        out: list[bytes] = []
        if not self.started:
            self.started = True
            out.append(_json({"type": "message_start", "message": {
                "id": chunk.get("id") or self.id, "type": "message", "role": "assistant", "model": chunk.get("model"),
                "content": [], "stop_reason": None, "stop_sequence": None, "usage": dict(self.usage)}}))
        if chunk.get("usage"):
            self.usage = usage_to_anthropic(chunk["usage"])
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if delta.get("content"):
                out += self._open("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or ():
                function = call.get("function") or {}
                index = call.get("index", 0)
                if index not in self.tools:
                    out += self._open(f"tool{index}", {"type": "tool_use", "id": call.get("id"),
                                                       "name": function.get("name"), "input": {}})
                    self.tools[index] = self.block
                if function.get("arguments"):
                    out.append(self._delta({"type": "input_json_delta", "partial_json": function["arguments"]}))
            if choice.get("finish_reason"):
                self.stop_reason = _stop_reason(choice["finish_reason"], bool(self.tools))
        return out

    def _open(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        if self.block_kind == kind:
            return []
        out = self._close()
        self.block += 1
        self.block_kind = kind
        return [*out, _json({"type": "content_block_start", "index": self.block, "content_block": block})]

    def _close(self) -> list[bytes]:
        if not self.block_kind:
            return []
        self.block_kind = ""
        return [_json({"type": "content_block_stop", "index": self.block})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _json({"type": "content_block_delta", "index": self.block, "delta": delta})



# -- Anthropic engine → OpenAI client ------------------------------------------------------------
def anthropic_answer_to_openai(data: dict[str, Any]) -> dict[str, Any]:
    texts, calls, reasoning = [], [], []
    for block in data.get("content") or ():
        kind = block.get("type")
        if kind == "text":
            texts.append(block.get("text", ""))
        elif kind == "tool_use":
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block.get("name"), "arguments": orjson.dumps(block.get("input")).decode()}})
        elif kind == "thinking":
            reasoning.append(block.get("thinking", ""))
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None,
                               "refusal": None}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    return {"id": data.get("id"), "object": "chat.completion", "model": data.get("model"),
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": _STOP_TO_OPENAI.get(str(data.get("stop_reason")), "stop")}],
            "usage": usage_to_openai(data.get("usage"))}


def usage_to_openai(usage: Any) -> dict[str, Any]:
    usage = usage if isinstance(usage, dict) else {}
    cached = usage.get("cache_read_input_tokens") or 0
    prompt = (usage.get("input_tokens") or 0) + cached + (usage.get("cache_creation_input_tokens") or 0)
    completion = usage.get("output_tokens") or 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class AnthropicToOpenAIEvents:
    """An Anthropic engine's Messages events as an OpenAI client's chat chunks."""

    def __init__(self) -> None:
        self.head: dict[str, Any] = {"id": "chatcmpl-spine", "object": "chat.completion.chunk", "created": 0,
                                     "model": ""}
        self.tools: dict[int, int] = {}  # the engine's block index → the tool call's index
        self.usage: dict[str, Any] = {}

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        return _json({**self.head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                "finish_reason": finish}]})

    def feed(self, event: dict[str, Any]) -> list[bytes]:
        kind = event.get("type")
        if kind == "message_start":
            message = event.get("message") or {}
            self.head["id"], self.head["model"] = message.get("id") or self.head["id"], message.get("model") or ""
            self.usage = dict(message.get("usage") or {})
            return [self._chunk({"role": "assistant", "content": ""})]
        if kind == "content_block_start":
            block = event.get("content_block") or {}
            if block.get("type") == "tool_use":
                index = self.tools.setdefault(event.get("index", 0), len(self.tools))
                return [self._chunk({"tool_calls": [{"index": index, "id": block.get("id"), "type": "function",
                                                     "function": {"name": block.get("name"), "arguments": ""}}]})]
            return []
        if kind == "content_block_delta":
            delta = event.get("delta") or {}
            if delta.get("type") == "text_delta":
                return [self._chunk({"content": delta.get("text", "")})]
            if delta.get("type") == "input_json_delta":
                index = self.tools.get(event.get("index", 0), 0)
                return [self._chunk({"tool_calls": [{"index": index,
                                                     "function": {"arguments": delta.get("partial_json", "")}}]})]
            if delta.get("type") == "thinking_delta":
                return [self._chunk({"reasoning_content": delta.get("thinking", "")})]
            return []
        if kind == "message_delta":
            self.usage.update(event.get("usage") or {})
            finish = _STOP_TO_OPENAI.get(str((event.get("delta") or {}).get("stop_reason")), "stop")
            return [self._chunk({}, finish),
                    _json({**self.head, "choices": [], "usage": usage_to_openai(self.usage)})]
        return []



class Passthrough:
    """The engine's events as they were, for a client of the engine's own API."""

    def __init__(self, api: str) -> None:
        self.api = api

    def feed(self, data: str) -> list[bytes]:
        return [] if data == "[DONE]" else [data.encode()]


def _json(value: Any) -> bytes:
    return orjson.dumps(value)
