"""A client's whole request to an engine, and the engine's answer back, across the two APIs.

When the client's API (`GenerateRequest.api`) is the engine's protocol, the request goes as
the client sent it: only `model` (the engine's name for it) and the stream flags are set, so
tools, response formats, images, logprobs and fields the spine does not know reach the
engine whole, and its answer comes back whole. When they differ (an Anthropic client, an
OpenAI-protocol engine, or the reverse), text, system prompts, tools, tool calls and their
results, images, stop sequences and usage are translated both ways, streams too; a field
with no counterpart is refused (`Untranslatable`, the client's 400) naming it, never dropped
— except Anthropic's `cache_control`, a caching hint that changes no answer.

This module decides which (`request_body`) and names the APIs; the translations are
`request_translation` (requests) and `answer_translation` (answers and streams), whose names
are importable from here too.
"""

from __future__ import annotations

from typing import Any

import orjson

from services.inference.upstream.answer_translation import (
    AnthropicToOpenAIEvents,
    OpenAIToAnthropicEvents,
    Passthrough,
    anthropic_answer_to_openai,
    openai_answer_to_anthropic,
    usage_to_anthropic,
    usage_to_openai,
)
from services.inference.upstream.request_translation import (
    Untranslatable,
    anthropic_to_openai,
    openai_to_anthropic,
)

__all__ = ["ANTHROPIC", "API_OF_PROTOCOL", "EMBEDDINGS", "OPENAI", "AnthropicToOpenAIEvents",
           "OpenAIToAnthropicEvents", "Passthrough", "Untranslatable", "anthropic_answer_to_openai",
           "anthropic_to_openai", "openai_answer_to_anthropic", "openai_to_anthropic", "request_body",
           "usage_to_anthropic", "usage_to_openai"]

OPENAI = "openai.chat"
ANTHROPIC = "anthropic.messages"
EMBEDDINGS = "openai.embeddings"  # POST /v1/embeddings: to an OpenAI-protocol engine's /embeddings, as sent
API_OF_PROTOCOL = {"openai": OPENAI, "anthropic": ANTHROPIC}


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

