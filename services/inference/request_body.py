"""What of a client's whole request (`GenerateRequest.body`) a built-in model cannot honour.

The HTTP front passes every field of a chat request on in its body, because an upstream
engine may honour any of them; it cannot know which model the router picks. A built-in model
reads `system`, `prompt` and `messages` (their text), `max_tokens`, `temperature`, `seed` and
stop strings (`services.inference.stop_strings`),
so the fields that would change an answer it cannot give are refused here, by name, as the
client's 400 (INVALID_ARGUMENT) — never silently ignored. Fields that only describe the
request (`user`, `metadata`, `stream_options`, `service_tier`) and caching hints pass.
"""

from __future__ import annotations

from typing import Any

import orjson

# Per client API: fields a built-in model refuses when set (to anything but an empty value).
REFUSED = {
    "openai.chat": ("tools", "functions", "tool_choice", "function_call", "parallel_tool_calls", "logprobs",
                    "top_logprobs", "logit_bias", "audio", "prediction", "response_format",
                    "modalities", "web_search_options"),
    "anthropic.messages": ("tools", "tool_choice", "thinking", "mcp_servers", "container"),
}
_EMPTY: tuple[Any, ...] = (None, [], "", {}, False)


def builtin_refusal(api: str, raw: bytes, model: str) -> str | None:
    """Why built-in `model` cannot answer the request whose body is `raw` (None: it can)."""
    if api == "openai.embeddings":  # answered before this by a backend that pools (`Embedder`)
        return (f"embeddings: the built-in model {model!r} does not embed; route the request to a model with "
                "upstream: (an engine serving /v1/embeddings)")
    if not raw or api not in REFUSED:
        return None
    body = orjson.loads(raw)
    if not isinstance(body, dict):
        return None
    where = f"the built-in model {model!r} (a router model with upstream: passes it to its engine)"
    for name in REFUSED[api]:
        if body.get(name) not in _EMPTY:
            return f"{name}: not supported by {where}"
    n = body.get("n")
    if api == "openai.chat" and n not in (None, 1):
        return f"n: only 1 choice per request is supported by {where}; got {n}"
    messages = body.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        if not isinstance(message, dict):
            continue
        if message.get("role") in ("tool", "function") or message.get("tool_calls"):
            return f"messages[{i}]: tool calls and results are not supported by {where}"
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                return f"messages[{i}].content[{j}].type: only 'text' parts are supported by {where}; got {kind!r}"
    system = body.get("system")
    for j, part in enumerate(system if isinstance(system, list) else ()):
        if not isinstance(part, dict) or part.get("type") != "text":
            return f"system[{j}].type: only 'text' blocks are supported by {where}"
    return None
