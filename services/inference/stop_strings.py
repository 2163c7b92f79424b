"""Stop strings for the built-in models: the answer ends where one first appears.

A client's `stop` (OpenAI: a string or a list) or `stop_sequences` (Anthropic) travel in the
request's body (`GenerateRequest.body`). Models generate tokens, and a stop string may span
several of them, or end in the middle of one; so the text is checked as it grows, the answer
ends before the first stop string (which is not part of it, as in both APIs), and a stream
holds back the tail that could still become one, so a client never sees half of a stop string
that then completes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

MAX_STOPS = 16  # more than either API allows (OpenAI 4, Anthropic's practical limit): bounds the checks


class BadStop(ValueError):
    """A `stop` that is not a string or a list of non-empty strings; the message names the field."""


def stops_of(api: str, raw: bytes) -> tuple[str, ...]:
    """The request's stop strings (none: an empty tuple)."""
    if not raw or not api:
        return ()
    body = orjson.loads(raw)
    name = "stop_sequences" if api == "anthropic.messages" else "stop"
    value: Any = body.get(name) if isinstance(body, dict) else None
    if value is None:
        return ()
    values = [value] if isinstance(value, str) and name == "stop" else value
    if not isinstance(values, list) or not all(isinstance(v, str) and v for v in values):
        raise BadStop(f"{name}: must be {'a string or ' if name == 'stop' else ''}a list of non-empty strings")
    if len(values) > MAX_STOPS:
        raise BadStop(f"{name}: at most {MAX_STOPS} stop strings, got {len(values)}")
    return tuple(values)


def first_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """(where, which) of the earliest stop string in `text`; None when none is there."""
    found = [(at, stop) for stop in stops if (at := text.find(stop)) >= 0]
    return min(found) if found else None


def safe_length(text: str, stops: Sequence[str]) -> int:
    """How much of `text` can be shown now: all but a tail that is the start of a stop string."""
    held = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:size]):
                held = size
                break
    return len(text) - held
