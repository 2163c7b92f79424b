"""OpenAI's Responses API, `POST /v1/responses`, served over chat completions.

A Responses request is rewritten as the chat-completions request it means — `instructions` a
system message, `input` (a string, or items: messages with text and image parts,
`function_call` and `function_call_output` items) the messages, function `tools`,
`tool_choice`, `text.format` the `response_format`, `max_output_tokens` the `max_tokens` —
and then read exactly as a chat request (`openai_api.parse_chat`), so every model serves it:
an upstream engine gets the chat request whole, a built-in model what it can honour. The
answer (the engine's chat completion, or a built-in model's text) becomes a `response` object
with `message` and `function_call` output items; a stream becomes the typed events
`response.created`, `response.in_progress`, `response.output_item.added`,
`response.content_part.added`, `response.output_text.delta`…, `response.function_call_arguments.delta`…,
the matching `.done` events and `response.completed`.

Why over chat completions rather than an engine's own `/v1/responses`: every engine the spine
fronts speaks chat completions, few speak Responses, and the spine cannot ask which without a
call per request. `previous_response_id` (and `conversation`) are refused: the spine stores no
responses (a store with the durability of its other state would be one more database to run,
and keeping clients' conversations is a retention decision the operator has not made), so the
client sends the conversation in `input`, as with `store: false`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import orjson

from runtime.http import fields, openai_api
from runtime.http.wire import COUNTED_BY, HttpError, bad_request
from wire.v1 import generation_pb2

NAME = "responses"
OVERLOADED_STATUS = openai_api.OVERLOADED_STATUS
error_body = openai_api.error_body
_PASSED = ("temperature", "top_p", "user", "metadata", "parallel_tool_calls", "seed", "service_tier")
_IGNORED = ("store", "stream", "instructions", "input", "model", "tools", "tool_choice", "text",
            "max_output_tokens", "reasoning", "truncation")
_REFUSED = {"previous_response_id": "this server stores no responses; send the whole conversation in input",
            "conversation": "this server stores no conversations; send the whole conversation in input",
            "background": "this server answers in the foreground only",
            "prompt": "stored prompt templates are not supported; send instructions and input"}


@dataclass
class Parsed:
    request: generation_pb2.GenerateRequest
    stream: bool
    body: dict[str, Any]
    chat: bool = True


def _content(content: Any, where: str) -> Any:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}: must be a string or a list of content parts")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": part.get("text")})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise bad_request(f"{where}[{j}].image_url: required, a URL or a data: URL (file_id is not supported)")
            image: dict[str, Any] = {"url": url}
            if part.get("detail"):
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        else:
            raise bad_request(f"{where}[{j}].type: {kind!r} parts are not supported (input_text, input_image)")
    return parts


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        messages.append({"role": "system", "content": fields.string(body, "instructions")})
    given = body.get("input")
    if isinstance(given, str):
        return [*messages, {"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise bad_request("input: required, a string or a non-empty array of items")
    for i, item in enumerate(given):
        if not isinstance(item, dict):
            raise bad_request(f"input[{i}]: must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"input[{i}].role: must be user, assistant, system or developer; got {role!r}")
            messages.append({"role": role, "content": _content(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else orjson.dumps(output).decode()})
        else:
            raise bad_request(f"input[{i}].type: {kind!r} items are not supported "
                              "(message, function_call, function_call_output)")
    return messages


def _tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    tools = []
    for i, tool in enumerate(body.get("tools") or ()):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad_request(f"tools[{i}].type: only function tools are supported, got {kind!r}")
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
        tools.append({"type": "function", "function": function})
    return tools


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat-completions request a Responses request means."""
    for name, why in _REFUSED.items():
        if body.get(name) is not None:
            raise bad_request(f"{name}: not supported: {why}")
    unknown = sorted(set(body) - set(_PASSED) - set(_IGNORED))
    if unknown:
        raise bad_request(f"{', '.join(unknown)}: not supported by this server's Responses API")
    chat: dict[str, Any] = {"model": body.get("model"), "messages": _messages(body)}
    chat.update({name: body[name] for name in _PASSED if body.get(name) is not None})
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    tools = _tools(body)
    if tools:
        chat["tools"] = tools
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice is not None:
        chat["tool_choice"] = choice
    text = body.get("text")
    response_format = text.get("format") if isinstance(text, dict) else None
    if isinstance(response_format, dict) and response_format.get("type") == "json_schema":
        spec = {key: response_format[key] for key in ("name", "schema", "strict", "description")
                if key in response_format}
        chat["response_format"] = {"type": "json_schema", "json_schema": spec}
    elif isinstance(response_format, dict) and response_format.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif response_format is not None and response_format != {"type": "text"}:
        raise bad_request("text.format.type: must be text, json_object or json_schema")
    return chat


def parse(body: Any, default_max_tokens: int) -> Parsed:
    body = dict(fields.body_object(body))
    chat = to_chat(body)
    parsed = openai_api.parse_chat(chat, default_max_tokens)
    return Parsed(parsed.request, fields.boolean(body, "stream"), body)


def _usage(prompt: int, completion: int, cached: int = 0, reasoning: int = 0, counted_by: str = "") -> dict[str, Any]:
    usage: dict[str, Any] = {"input_tokens": prompt, "output_tokens": completion, "total_tokens": prompt + completion,
                             "input_tokens_details": {"cached_tokens": cached},
                             "output_tokens_details": {"reasoning_tokens": reasoning}}
    if counted_by:
        usage[COUNTED_BY] = counted_by
    return usage


def _usage_of_chat(usage: Any) -> dict[str, Any]:
    usage = usage if isinstance(usage, dict) else {}
    return _usage(usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0,
                  (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
                  (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0)


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _response(parsed: Parsed, request_id: str, model: str, output: list[dict[str, Any]], usage: Any,
              finish: str, status: str = "completed") -> dict[str, Any]:
    body = parsed.body
    incomplete = finish == "length" and status == "completed"
    return {"id": f"resp_{request_id}", "object": "response", "created_at": int(time.time()),
            "status": "incomplete" if incomplete else status, "model": model, "output": output,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "error": None,
            "instructions": body.get("instructions"), "metadata": body.get("metadata") or {},
            "parallel_tool_calls": body.get("parallel_tool_calls", True), "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "text": body.get("text") or {"format": {"type": "text"}}, "max_output_tokens": body.get("max_output_tokens"),
            "store": False, "usage": usage}


def answer(parsed: Parsed, response: generation_pb2.GenerateResponse, request_id: str, counted_by: str = "") -> bytes:
    output: list[dict[str, Any]] = []
    finish = response.finish_reason or "length"
    if response.body:  # an engine's chat completion
        data = orjson.loads(response.body)
        choice = (data.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        if message.get("content"):
            output.append(_message_item(f"msg_{request_id}", message["content"]))
        for i, call in enumerate(message.get("tool_calls") or ()):
            function = call.get("function") or {}
            output.append(_call_item(f"fc_{request_id}_{i}", str(call.get("id")), str(function.get("name")),
                                     str(function.get("arguments") or "")))
        finish = "length" if choice.get("finish_reason") == "length" else "stop"
        usage = _usage_of_chat(data.get("usage")) if isinstance(data.get("usage"), dict) else _usage(
            response.prompt_tokens, response.completion_tokens)
        if counted_by:
            usage[COUNTED_BY] = counted_by
    else:
        output.append(_message_item(f"msg_{request_id}", response.text))
        usage = _usage(response.prompt_tokens, response.completion_tokens, response.cached_prompt_tokens,
                       counted_by=counted_by)
    return orjson.dumps(_response(parsed, request_id, response.model, output, usage, finish))


class Stream:
    """The typed events of one streamed response, from chat chunks (an engine's) or text pieces."""

    def __init__(self, parsed: Parsed, request_id: str) -> None:
        self.parsed = parsed
        self.request_id = request_id
        self.model = parsed.request.model
        self.raw = False
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # the items, as they grow
        self.text_item = -1  # the output index of the open message item (-1: none)
        self.calls: dict[int, int] = {}  # the engine's tool-call index → its item's output index
        self.usage: dict[str, Any] | None = None
        self.finish = ""

    def _event(self, kind: str, **data: Any) -> bytes:
        self.sequence += 1
        payload = {"type": kind, "sequence_number": self.sequence - 1, **data}
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

    def _snapshot(self, status: str, usage: Any = None, finish: str = "") -> dict[str, Any]:
        return _response(self.parsed, self.request_id, self.model, self.output, usage, finish, status)

    def start(self, model: str, prompt_tokens: int) -> bytes:
        self.model = model or self.model
        return (self._event("response.created", response=self._snapshot("in_progress"))
                + self._event("response.in_progress", response=self._snapshot("in_progress")))

    def _text(self, piece: str) -> bytes:
        out = b""
        if self.text_item < 0:
            self.text_item = len(self.output)
            item = _message_item(f"msg_{self.request_id}", "", "in_progress")
            self.output.append(item)
            out += self._event("response.output_item.added", output_index=self.text_item,
                               item={**item, "content": []})
            out += self._event("response.content_part.added", item_id=item["id"], output_index=self.text_item,
                               content_index=0, part={"type": "output_text", "text": "", "annotations": []})
        item = self.output[self.text_item]
        item["content"][0]["text"] += piece
        return out + self._event("response.output_text.delta", item_id=item["id"], output_index=self.text_item,
                                 content_index=0, delta=piece)

    def _call(self, call: dict[str, Any]) -> bytes:
        out = b""
        index = call.get("index", 0)
        function = call.get("function") or {}
        if index not in self.calls:
            self.calls[index] = len(self.output)
            item = _call_item(f"fc_{self.request_id}_{index}", str(call.get("id")), str(function.get("name")), "",
                              "in_progress")
            self.output.append(item)
            out += self._event("response.output_item.added", output_index=self.calls[index], item=item)
        item = self.output[self.calls[index]]
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            out += self._event("response.function_call_arguments.delta", item_id=item["id"],
                               output_index=self.calls[index], delta=function["arguments"])
        return out

    def piece(self, chunk: generation_pb2.GenerateChunk) -> bytes:
        if not self.raw:
            return self._text(chunk.text) if chunk.text else b""
        out = b""
        for event in chunk.events:
            data = orjson.loads(event)
            if isinstance(data.get("usage"), dict):
                self.usage = _usage_of_chat(data["usage"])
            for choice in data.get("choices") or ():
                if choice.get("index", 0) != 0:
                    continue
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    out += self._text(delta["content"])
                for call in delta.get("tool_calls") or ():
                    out += self._call(call)
                if choice.get("finish_reason"):
                    self.finish = "length" if choice["finish_reason"] == "length" else "stop"
        return out

    def end(self, finish: str, prompt_tokens: int, completion_tokens: int, counted_by: str = "") -> bytes:
        out = b""
        for index, item in enumerate(self.output):
            item["status"] = "completed"
            if item["type"] == "message":
                text = item["content"][0]["text"]
                out += self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=text)
                out += self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=item["content"][0])
            else:
                out += self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   arguments=item["arguments"])
            out += self._event("response.output_item.done", output_index=index, item=item)
        usage = self.usage or _usage(prompt_tokens, completion_tokens)
        if counted_by:
            usage[COUNTED_BY] = counted_by
        done = self._snapshot("completed", usage, self.finish or finish or "stop")
        kind = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
        return out + self._event(kind, response=done)

    def error(self, error: HttpError, request_id: str) -> bytes:
        return self._event("error", code=error.kind, message=error.message, param=None)
