"""Reading a JSON request body field by field: each wrong type or value is a 400 naming the field.

JSON has one number type, and Python's bool is an int: `max_tokens: true` or `1.5` must be
refused, not read as 1, so every reader checks the exact type.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from runtime.http.wire import MAX_INT32, bad_request

_MISSING = object()


def body_object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {_kind(body)}")
    return body


def integer(body: Mapping[str, Any], name: str, default: Any = _MISSING, *,
            low: int = -(2**63), high: int = 2**63 - 1) -> Any:
    value = body.get(name, default)
    if value is _MISSING:
        raise bad_request(f"{name}: required")
    if value is None or value is default:
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name}: must be an integer, got {_kind(value)}")
    if not low <= value <= high:
        raise bad_request(f"{name}: must be between {low} and {high}, got {value}")
    return value


def max_tokens(body: Mapping[str, Any], name: str, default: Any = _MISSING) -> Any:
    """A token count: the pipeline checks it against its own limit, but it must fit the wire."""
    return integer(body, name, default, low=-MAX_INT32, high=MAX_INT32)


def number(body: Mapping[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad_request(f"{name}: must be a number, got {_kind(value)}")
    return float(value)


def boolean(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name}: must be true or false, got {_kind(value)}")
    return value


def string(body: Mapping[str, Any], name: str, default: Any = _MISSING) -> Any:
    value = body.get(name, default)
    if value is _MISSING:
        raise bad_request(f"{name}: required")
    if value is default:
        return value
    if not isinstance(value, str):
        raise bad_request(f"{name}: must be a string, got {_kind(value)}")
    return value


def plain_text(content: Any, where: str) -> str:
    """A message's text parts joined, whatever other parts (images, audio, files, tool results)
    it carries beside them: those travel in the request's body to an engine that reads them
    (`GenerateRequest.body`); a built-in model refuses them by name. `null` (an assistant turn
    that only calls tools) reads as no text. Each part must still be an object with a `type`."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request(f"{where}: must be a string or a list of content parts, got {_kind(content)}")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict):
            raise bad_request(f"{where}[{i}]: must be an object, got {_kind(part)}")
        kind = part.get("type")
        if not isinstance(kind, str):
            raise bad_request(f"{where}[{i}].type: must be a string, got {_kind(kind)}")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request(f"{where}[{i}].text: must be a string, got {_kind(text)}")
            texts.append(text)
    return "".join(texts)


def refuse_unsupported(body: Mapping[str, Any], names: tuple[str, ...]) -> None:
    """Fields this server cannot honour: refused when set, rather than silently ignored."""
    for name in names:
        value = body.get(name)
        if value not in (None, [], "", {}):
            raise bad_request(f"{name}: not supported by this server")


def kind_of(value: Any) -> str:
    """How a message names a value's JSON type ("an object", "the number 3")."""
    return _kind(value)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return f"the number {value!r}"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
