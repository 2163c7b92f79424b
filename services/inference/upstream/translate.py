"""A client's whole request to an engine, and the engine's answer back, across the two APIs.

When the client's API (`GenerateRequest.api`) is the engine's protocol, the request goes as
the client sent it: only `model` (the engine's name for it) and the stream flags are set, so
tools, response formats, images, logprobs and fields the spine does not know reach the
engine whole, and its answer comes back whole. When they differ (an Anthropic client, an
OpenAI-protocol engine, or the reverse), text, system prompts, tools, tool calls and their
results, images, stop sequences and usage are translated both ways, streams too; a field
with no counterpart is refused (`Untranslatable`, the client's 400) naming it, never dropped
— except Anthropic's `cache_control`, a caching hint that changes no answer.
"""

from __future__ import annotations

from typing import Any

import orjson

OPENAI = "openai.chat"
ANTHROPIC = "anthropic.messages"
EMBEDDINGS = "openai.embeddings"  # POST /v1/embeddings: to an OpenAI-protocol engine's /embeddings, as sent
API_OF_PROTOCOL = {"openai": OPENAI, "anthropic": ANTHROPIC}

# Anthropic → OpenAI: fields read below; anything else in a Messages request has no translation.
_ANTHROPIC_READ = {"model", "messages", "system", "max_tokens", "temperature", "top_p", "stop_sequences", "stream",
                   "tools", "tool_choice", "metadata", "service_tier"}
# OpenAI → Anthropic: the same the other way.
_OPENAI_READ = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "stream",
                "stream_options", "tools", "tool_choice", "parallel_tool_calls", "user", "n", "service_tier",
                "metadata", "store"}
_FINISH_TO_ANTHROPIC = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                        "function_call": "tool_use", "content_filter": "refusal"}
_STOP_TO_OPENAI = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls",
                   "refusal": "content_filter", "pause_turn": "stop"}


class Untranslatable(ValueError):
    """A field of the client's request that the engine's protocol has no counterpart for."""


def request_body(api: str, raw: bytes, protocol: str, model: str, stream: bool) -> dict[str, Any]:
    """The body to send an engine speaking `protocol`, from the client's `raw` body in `api`."""
    body = orjson.loads(raw)
    if not isinstance(body, dict):
        raise Untranslatable("the request body is not a JSON object")
    target = API_OF_PROTOCOL[protocol]
    if api == EMBEDDINGS:
        if protocol != "openai":
            raise Untranslatable("embeddings: an Anthropic-protocol engine has no embeddings endpoint")
        return {**body, "model": model}
    if api == target:
        out = dict(body)
    elif api == ANTHROPIC:
        out = anthropic_to_openai(body)
    elif api == OPENAI:
        out = openai_to_anthropic(body)
    else:
        raise Untranslatable(f"requests of the {api!r} API cannot be sent to an engine speaking {protocol}")
    out["model"] = model
    out.pop("stream", None)
    if target == OPENAI:
        out.pop("stream_options", None)
        if stream:  # its usage, for the limits and spend; a client that did not ask is not shown it
            out["stream"] = True
            out["stream_options"] = {**(body.get("stream_options") or {} if api == OPENAI else {}), "include_usage": True}
    elif stream:
        out["stream"] = True
    return out


# -- Anthropic client → OpenAI engine ------------------------------------------------------------
def _refuse_unread(body: dict[str, Any], read: set[str], engine: str) -> None:
    extra = sorted(name for name, value in body.items() if name not in read and value is not None)
    if extra:
        raise Untranslatable(f"{', '.join(extra)}: no translation to the {engine} protocol of this model's engine")


def _text_of_system(system: Any) -> str:
    if isinstance(system, str):
        return system
    return "".join(block.get("text", "") for block in system or () if isinstance(block, dict))


def _image_to_openai(block: dict[str, Any], where: str) -> dict[str, Any]:
    source = block.get("source") or {}
    if source.get("type") == "base64":
        return {"type": "image_url", "image_url": {"url": f"data:{source.get('media_type')};base64,{source.get('data')}"}}
    if source.get("type") == "url":
        return {"type": "image_url", "image_url": {"url": source.get("url")}}
    raise Untranslatable(f"{where}.source.type: {source.get('type')!r} images have no OpenAI translation")


def _tool_result_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise Untranslatable(f"{where}.content[{j}]: only text tool results have an OpenAI translation")
        texts.append(block.get("text", ""))
    return "".join(texts)


def anthropic_to_openai(body: dict[str, Any]) -> dict[str, Any]:
    _refuse_unread(body, _ANTHROPIC_READ, "OpenAI")
    messages: list[dict[str, Any]] = []
    system = _text_of_system(body.get("system"))
    if system:
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(body.get("messages") or ()):
        role, content = message.get("role"), message.get("content")
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
            continue
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        for j, block in enumerate(content or ()):
            where = f"messages[{i}].content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": block.get("text", "")})
            elif kind == "image":
                parts.append(_image_to_openai(block, where))
            elif kind == "tool_use":
                calls.append({"id": block.get("id"), "type": "function",
                              "function": {"name": block.get("name"),
                                           "arguments": orjson.dumps(block.get("input", {})).decode()}})
            elif kind == "tool_result":
                text = _tool_result_text(block.get("content"), where)
                if block.get("is_error"):
                    text = f"Error: {text}"
                results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": text})
            elif kind in ("thinking", "redacted_thinking"):
                continue  # the model's earlier reasoning: an OpenAI engine is not shown it back
            else:
                raise Untranslatable(f"{where}.type: {kind!r} blocks have no OpenAI translation")
        messages.extend(results)
        if role == "assistant":
            text = "".join(part["text"] for part in parts if part["type"] == "text")
            turn: dict[str, Any] = {"role": "assistant", "content": text or None}
            if calls:
                turn["tool_calls"] = calls
            if text or calls:
                messages.append(turn)
        elif parts:
            messages.append({"role": role, "content": parts})
    out: dict[str, Any] = {"messages": messages, "max_tokens": body.get("max_tokens")}
    for name in ("temperature", "top_p"):
        if body.get(name) is not None:
            out[name] = body[name]
    if body.get("stop_sequences"):
        out["stop"] = body["stop_sequences"]
    user = (body.get("metadata") or {}).get("user_id")
    if isinstance(user, str):
        out["user"] = user
    if body.get("tools"):
        out["tools"] = [_tool_to_openai(tool, i) for i, tool in enumerate(body["tools"])]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        kind = choice.get("type")
        out["tool_choice"] = ({"type": "function", "function": {"name": choice.get("name")}} if kind == "tool"
                              else {"any": "required"}.get(str(kind), kind))
        if choice.get("disable_parallel_tool_use"):
            out["parallel_tool_calls"] = False
    return out


def _tool_to_openai(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if tool.get("type") not in (None, "custom"):
        raise Untranslatable(f"tools[{i}].type: Anthropic's {tool.get('type')!r} tool has no OpenAI translation")
    function = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
    if tool.get("description"):
        function["description"] = tool["description"]
    if isinstance(tool.get("strict"), bool):  # the engine then holds the call's input to the schema
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def _arguments(raw: Any) -> Any:
    """A tool call's arguments as an object: the engine's JSON, or its text where it is not JSON
    (the spine passes on what the engine said; it does not judge it)."""
    if not isinstance(raw, str):
        return raw if raw is not None else {}
    try:
        return orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError:
        return raw


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
                        "input": _arguments(function.get("arguments"))})
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


# -- OpenAI client → Anthropic engine ------------------------------------------------------------
def _image_to_anthropic(part: dict[str, Any], where: str) -> dict[str, Any]:
    url = (part.get("image_url") or {}).get("url", "")
    if url.startswith("data:"):
        head, _, data = url.partition(",")
        media_type, _, encoding = head[5:].partition(";")
        if encoding != "base64":
            raise Untranslatable(f"{where}.image_url.url: only base64 data: URLs have an Anthropic translation")
        return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}
    return {"type": "image", "source": {"type": "url", "url": url}}


def _parts_to_anthropic(content: Any, where: str) -> list[dict[str, Any]]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    blocks = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind == "text":
            blocks.append({"type": "text", "text": part.get("text", "")})
        elif kind == "image_url":
            blocks.append(_image_to_anthropic(part, f"{where}[{j}]"))
        else:
            raise Untranslatable(f"{where}[{j}].type: {kind!r} parts have no Anthropic translation")
    return blocks


def openai_to_anthropic(body: dict[str, Any]) -> dict[str, Any]:
    _refuse_unread(body, _OPENAI_READ, "Anthropic")
    if body.get("n") not in (None, 1):
        raise Untranslatable("n: an Anthropic engine answers one choice per request")
    system: list[str] = []
    messages: list[dict[str, Any]] = []

    def add(role: str, blocks: list[dict[str, Any]]) -> None:
        if messages and messages[-1]["role"] == role:  # Anthropic's turns alternate: merge
            messages[-1]["content"].extend(blocks)
        elif blocks:
            messages.append({"role": role, "content": blocks})

    for i, message in enumerate(body.get("messages") or ()):
        role, where = message.get("role"), f"messages[{i}].content"
        if role in ("system", "developer"):
            system.append("".join(b["text"] for b in _parts_to_anthropic(message.get("content"), where)))
        elif role == "user":
            add("user", _parts_to_anthropic(message.get("content"), where))
        elif role == "assistant":
            blocks = _parts_to_anthropic(message.get("content"), where)
            for call in message.get("tool_calls") or ():
                function = call.get("function") or {}
                blocks.append({"type": "tool_use", "id": call.get("id"), "name": function.get("name"),
                               "input": _arguments(function.get("arguments"))})
            add("assistant", blocks)
        elif role == "tool":
            content = message.get("content")
            text = content if isinstance(content, str) else "".join(
                b["text"] for b in _parts_to_anthropic(content, where))
            add("user", [{"type": "tool_result", "tool_use_id": message.get("tool_call_id"), "content": text}])
        else:
            raise Untranslatable(f"messages[{i}].role: {role!r} has no Anthropic translation")
    tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    out: dict[str, Any] = {"messages": messages, "max_tokens": tokens}
    if system:
        out["system"] = "\n\n".join(system)
    if body.get("temperature") is not None:  # Anthropic's runs 0..1, OpenAI's 0..2: the nearest it takes
        out["temperature"] = min(float(body["temperature"]), 1.0)
    if body.get("top_p") is not None:
        out["top_p"] = body["top_p"]
    stop = body.get("stop")
    if stop:
        out["stop_sequences"] = [stop] if isinstance(stop, str) else stop
    if isinstance(body.get("user"), str):
        out["metadata"] = {"user_id": body["user"]}
    if body.get("tools"):
        out["tools"] = [_tool_to_anthropic(tool, i) for i, tool in enumerate(body["tools"])]
    choice = body.get("tool_choice")
    if choice is not None:
        if isinstance(choice, dict):
            out["tool_choice"] = {"type": "tool", "name": (choice.get("function") or {}).get("name")}
        else:
            out["tool_choice"] = {"type": {"required": "any"}.get(choice, choice)}
        if body.get("parallel_tool_calls") is False and choice != "none":
            out["tool_choice"]["disable_parallel_tool_use"] = True
    return out


def _tool_to_anthropic(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if tool.get("type", "function") != "function":
        raise Untranslatable(f"tools[{i}].type: {tool.get('type')!r} tools have no Anthropic translation")
    function = tool.get("function") or {}
    out = {"name": function.get("name"), "input_schema": function.get("parameters") or {"type": "object"}}
    if function.get("description"):
        out["description"] = function["description"]
    if isinstance(function.get("strict"), bool):
        out["strict"] = function["strict"]
    return out


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
