"""What the middlewares read of a request's whole body (`GenerateRequest.body`) and of the
engine's answer (`GenerateResponse.body`): the tools offered and called, the response format,
how many images, the sampling options the GenAI spans name — never the images' bytes or the
tools' arguments.

The pipeline decides on the plain reading of a request (its text); these few facts are what
limits and logs need beyond it. A tool definition is prompt the engine reads, so the rate
limiter charges its bytes at admission like the prompt's; the logs say which tools were
offered and which the model called, and that a request carried images (how many), so an
operator can tell an agent's traffic from a chat's without a log line ever holding an image.
"""

from __future__ import annotations

from typing import Any

import orjson

from wire.v1 import generation_pb2

MAX_NAMES_CHARS = 300  # a log field of tool names is cut here (a line must stay under its limit)


def _body(raw: bytes) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {}
    return body if isinstance(body, dict) else {}


def tool_definition_bytes(request: generation_pb2.GenerateRequest) -> int:
    """The bytes of the request's tool definitions (OpenAI `tools`/`functions`, Anthropic `tools`)."""
    if b'"tools"' not in request.body and b'"functions"' not in request.body:
        return 0
    body = _body(request.body)
    return sum(len(orjson.dumps(body[name])) for name in ("tools", "functions") if body.get(name))


def _tool_name(tool: Any) -> str:
    if not isinstance(tool, dict):
        return "?"
    function = tool.get("function")
    name = function.get("name") if isinstance(function, dict) else tool.get("name")
    return name if isinstance(name, str) else str(tool.get("type", "?"))


def _images(body: dict[str, Any]) -> int:
    count = 0
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") in ("image_url", "image", "input_image"):
                count += 1
    return count


def _clip(names: list[str]) -> str:
    joined = ",".join(names)
    return joined if len(joined) <= MAX_NAMES_CHARS else joined[:MAX_NAMES_CHARS] + "..."


def _called(answer: dict[str, Any]) -> list[str]:
    names: list[str] = []
    for choice in answer.get("choices") or ():  # OpenAI
        message = choice.get("message") if isinstance(choice, dict) else None
        for call in (message or {}).get("tool_calls") or ():
            names.append(_tool_name(call))
    for block in answer.get("content") or ():  # Anthropic
        if isinstance(block, dict) and block.get("type") == "tool_use":
            names.append(_tool_name(block))
    return names


def log_fields(request: generation_pb2.GenerateRequest,
               response: generation_pb2.GenerateResponse | None) -> dict[str, str]:
    """The log line's fields for the request's body and the engine's answer (none: no body)."""
    if not request.api:
        return {}
    body = _body(request.body)
    fields = {"api": request.api}
    tools = [_tool_name(tool) for tool in [*(body.get("tools") or ()), *(body.get("functions") or ())]]
    if tools:
        fields["tools_offered"] = _clip(tools)
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and isinstance(response_format.get("type"), str):
        fields["response_format"] = response_format["type"]
    images = _images(body)
    if images:
        fields["images"] = str(images)
    if response is not None and response.body:
        called = _called(_body(response.body))
        if called:
            fields["tools_called"] = _clip(called)
    return fields


def span_attributes(request: generation_pb2.GenerateRequest) -> dict[str, Any]:
    """The GenAI semantic conventions' request attributes that the body carries: the output
    type a response format asks for, the choice count, stop sequences, top_p/top_k and penalties."""
    if not request.api:
        return {}
    body = _body(request.body)
    out: dict[str, Any] = {}
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") in ("json_object", "json_schema"):
        out["gen_ai.output.type"] = "json"
    elif response_format is not None:
        out["gen_ai.output.type"] = "text"
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n != 1:
        out["gen_ai.request.choice.count"] = n
    stop = body.get("stop", body.get("stop_sequences"))
    stops = [stop] if isinstance(stop, str) else stop
    if isinstance(stops, list) and stops and all(isinstance(item, str) for item in stops):
        out["gen_ai.request.stop_sequences"] = tuple(stops)
    for name in ("top_p", "top_k", "frequency_penalty", "presence_penalty"):
        value = body.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[f"gen_ai.request.{name}"] = float(value)
    return out
