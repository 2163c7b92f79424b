"""A client's request in the other API: an Anthropic Messages request as OpenAI chat, and back.

Used when a client's API is not the engine's protocol (`translate.request_body` decides).
Text, system prompts, tools, tool calls and their results, images and stop sequences are
translated; a field with no counterpart is refused (`Untranslatable`, the client's 400)
naming it, never dropped — except Anthropic's `cache_control`, a caching hint that changes
no answer. Apart from the answers' translation (`answer_translation`) because a request is
checked field by field against what the other side can say, an answer only re-shaped.
"""

from __future__ import annotations

from typing import Any

import orjson

# Anthropic → OpenAI: fields read below; anything else in a Messages request has no translation.
_ANTHROPIC_READ = {"model", "messages", "system", "max_tokens", "temperature", "top_p", "stop_sequences", "stream",
                   "tools", "tool_choice", "metadata", "service_tier"}
# OpenAI → Anthropic: the same the other way.
_OPENAI_READ = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "stream",
                "stream_options", "tools", "tool_choice", "parallel_tool_calls", "user", "n", "service_tier",
                "metadata", "store"}


class Untranslatable(ValueError):
    """A field of the client's request that the engine's protocol has no counterpart for."""


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



def tool_arguments(raw: Any) -> Any:
    """A tool call's arguments as an object: the engine's JSON, or its text where it is not JSON
    (the spine passes on what the engine said; it does not judge it)."""
    if not isinstance(raw, str):
        return raw if raw is not None else {}
    try:
        return orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError:
        return raw


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
                               "input": tool_arguments(function.get("arguments"))})
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

