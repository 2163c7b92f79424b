"""The parts of a request an engine would choke on, checked before it is sent anywhere.

Tools, tool choices, response formats and images pass to an upstream engine as the client
sent them (`GenerateRequest.body`); what is malformed among them is the client's 400 here,
naming the field, rather than an engine's error (or worse, an engine that reads a broken
schema as no constraint at all). JSON Schemas are checked with `jsonschema`'s metaschema
check (draft 2020-12, as OpenAI's and Anthropic's tools read them). Image URLs are only
checked to be strings: the spine never fetches one — a URL goes to the engine untouched,
and the engine decides whether it will fetch it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from runtime.http.fields import kind_of
from runtime.http.wire import bad_request

RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def _schema(schema: Any, where: str) -> None:
    if not isinstance(schema, dict):
        raise bad_request(f"{where}: must be a JSON Schema object, got {kind_of(schema)}")
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as error:
        path = "".join(f"[{p!r}]" if isinstance(p, str) else f"[{p}]" for p in error.path)
        raise bad_request(f"{where}{path}: not a valid JSON Schema: {error.message}") from None


def _name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise bad_request(f"{where}: required, a non-empty string, got {kind_of(value)}")
    return value


def _list(body: Mapping[str, Any], name: str) -> list[Any]:
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_request(f"{name}: must be an array, got {kind_of(value)}")
    return value


def openai_chat(body: Mapping[str, Any]) -> None:
    """An OpenAI chat request's tools, tool_choice, response_format and image parts."""
    names: set[str] = set()
    for i, tool in enumerate(_list(body, "tools")):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad_request(f"{where}: must be an object, got {kind_of(tool)}")
        if tool.get("type", "function") != "function":
            continue  # other tool types (custom tools) are the engine's to judge
        function = tool.get("function")
        if not isinstance(function, dict):
            raise bad_request(f"{where}.function: required, an object with name and parameters")
        names.add(_name(function.get("name"), f"{where}.function.name"))
        if "parameters" in function:
            _schema(function["parameters"], f"{where}.function.parameters")
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") == "function":
            _name(name, "tool_choice.function.name")
            if names and name not in names:
                raise bad_request(f"tool_choice.function.name: {name!r} is not one of the tools offered "
                                  f"({', '.join(sorted(names))})")
    elif choice is not None and choice not in ("none", "auto", "required"):
        raise bad_request(f"tool_choice: must be none, auto, required or an object naming a function; got {choice!r}")
    response_format = body.get("response_format")
    if response_format is not None:
        if not isinstance(response_format, dict) or response_format.get("type") not in RESPONSE_FORMATS:
            raise bad_request(f"response_format.type: must be one of {', '.join(RESPONSE_FORMATS)}")
        if response_format["type"] == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict):
                raise bad_request("response_format.json_schema: required, an object with name and schema")
            _name(spec.get("name"), "response_format.json_schema.name")
            if "schema" in spec:
                _schema(spec["schema"], "response_format.json_schema.schema")
    for i, message in enumerate(_list(body, "messages")):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, dict) and part.get("type") == "image_url":
                image = part.get("image_url")
                url = image.get("url") if isinstance(image, dict) else None
                if not isinstance(url, str) or not url:
                    raise bad_request(f"messages[{i}].content[{j}].image_url.url: required, a URL or a data: URL")


def anthropic_messages(body: Mapping[str, Any]) -> None:
    """An Anthropic Messages request's tools, tool_choice and image blocks."""
    names: set[str] = set()
    for i, tool in enumerate(_list(body, "tools")):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad_request(f"{where}: must be an object, got {kind_of(tool)}")
        if tool.get("type") not in (None, "custom"):
            continue  # Anthropic's server tools (web search, bash, …) have no schema of their own
        names.add(_name(tool.get("name"), f"{where}.name"))
        if "input_schema" not in tool:
            raise bad_request(f"{where}.input_schema: required, a JSON Schema object")
        _schema(tool["input_schema"], f"{where}.input_schema")
    choice = body.get("tool_choice")
    if choice is not None:
        if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
            raise bad_request("tool_choice.type: must be one of auto, any, tool, none")
        if choice["type"] == "tool":
            name = _name(choice.get("name"), "tool_choice.name")
            if names and name not in names:
                raise bad_request(f"tool_choice.name: {name!r} is not one of the tools offered ({', '.join(sorted(names))})")
    for i, message in enumerate(_list(body, "messages")):
        content = message.get("content") if isinstance(message, dict) else None
        for j, block in enumerate(content if isinstance(content, list) else ()):
            if isinstance(block, dict) and block.get("type") == "image":
                source = block.get("source")
                if not isinstance(source, dict) or source.get("type") not in ("base64", "url", "file"):
                    raise bad_request(f"messages[{i}].content[{j}].source.type: must be base64, url or file")
