"""What of an engine's whole answer the output policy reads besides its text: the arguments of
the tool calls it makes.

An agent's answer is often nothing but a tool call, and a call's arguments reach a tool (a
shell, a database, an e-mail) with more consequence than prose. An upstream's answer travels as
its own JSON in the client's API (`GenerateResponse.body`, `GenerateChunk.events`): OpenAI's
`tool_calls[].function.arguments` (and their streamed pieces), Anthropic's `tool_use.input`
and `input_json_delta.partial_json`, the Responses API's `function_call.arguments` and
`response.function_call_arguments.delta`. Read by key, whichever API the answer is in.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import orjson

_ARGUMENT_KEYS = ("arguments", "partial_json")
_DONE_EVENTS = ("response.function_call_arguments.done", "response.output_item.done", "response.completed",
                "content_block_stop")  # repeat what their deltas already said


def tool_call_text(body: bytes) -> str:
    """The tool-call arguments in a whole answer (`GenerateResponse.body`), one per line."""
    return "\n".join(_arguments(_loads(body)))


def tool_call_pieces(events: Iterable[bytes]) -> str:
    """The tool-call argument pieces in one chunk's stream events, in order (each piece once:
    the events that repeat a call's whole arguments at its end are not read again)."""
    pieces: list[str] = []
    for raw in events:
        event = _loads(raw)
        if isinstance(event, dict) and event.get("type") in _DONE_EVENTS:
            continue
        pieces.extend(_arguments(event))
    return "".join(pieces)


def _arguments(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        if value.get("type") == "tool_use" and isinstance(value.get("input"), dict) and value["input"]:
            yield orjson.dumps(value["input"]).decode()
        for key, item in value.items():
            if key in _ARGUMENT_KEYS and isinstance(item, str) or key == "delta" and isinstance(item, str) and value.get("type") == \
                    "response.function_call_arguments.delta":
                yield item
            elif isinstance(item, dict | list):
                yield from _arguments(item)
    elif isinstance(value, list):
        for item in value:
            yield from _arguments(item)


def _loads(raw: bytes) -> Any:
    try:
        return orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError:
        return None
