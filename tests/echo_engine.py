"""The answers of an engine that honours everything, for `tests.fault_upstream`'s `echo` model.

It answers in the protocol it is asked in (OpenAI chat completions, or Anthropic Messages
at `/messages`), plain or streamed, with what a real engine sends for the fields a client
gave it: a forced tool call (`{"city": "Paris"}`) when `tool_choice` names a tool or
requires one, an answer quoting the tool's result after one, logprobs and `n` choices
where asked, a refusal when the prompt says "refuse", and usage with cached and reasoning
tokens. The fault upstream keeps every body it was sent (`received`), so a test can see
exactly what reached the engine.
"""

from __future__ import annotations

from typing import Any

import orjson

ARGUMENTS = '{"city": "Paris"}'
OPENAI_USAGE = {"prompt_tokens": 11, "completion_tokens": 2, "total_tokens": 13,
                "prompt_tokens_details": {"cached_tokens": 3}, "completion_tokens_details": {"reasoning_tokens": 1}}
ANTHROPIC_USAGE = {"input_tokens": 8, "cache_read_input_tokens": 3, "output_tokens": 2}


def _forced_tool(request: dict[str, Any]) -> str | None:
    """The tool a request forces a call of (OpenAI's or Anthropic's tool_choice), if any."""
    choice, tools = request.get("tool_choice"), request.get("tools") or []
    if isinstance(choice, dict):
        if choice.get("type") == "function":
            return str((choice.get("function") or {}).get("name"))
        if choice.get("type") == "tool":
            return str(choice.get("name"))
        if choice.get("type") == "any" and tools:
            return str(tools[0].get("name"))
    if choice == "required" and tools:
        return str((tools[0].get("function") or {}).get("name"))
    return None


def _reply_text(request: dict[str, Any]) -> str:
    """"ok", or after a tool's result, what the tool said."""
    for message in reversed(request.get("messages") or []):
        if message.get("role") == "tool":
            return f"the tool said {message.get('content')}"
        content = message.get("content")
        if isinstance(content, list):
            for block in content:
                if isinstance(block, dict) and block.get("type") == "tool_result":
                    return f"the tool said {block.get('content')}"
        break
    return "ok"


def _wants_refusal(request: dict[str, Any]) -> bool:
    return "refuse" in orjson.dumps(request.get("messages") or []).decode()


def _logprobs(text: str, top: int) -> dict[str, Any]:
    return {"content": [{"token": text, "logprob": -0.25, "bytes": list(text.encode()),
                         "top_logprobs": [{"token": text, "logprob": -0.25, "bytes": list(text.encode())}
                                          for _ in range(top)]}]}


def openai_answer(request: dict[str, Any]) -> bytes:
    tool = _forced_tool(request)
    choices = []
    for i in range(int(request.get("n") or 1)):
        message: dict[str, Any] = {"role": "assistant", "content": None, "refusal": None}
        finish = "stop"
        if tool is not None:
            message["tool_calls"] = [{"id": f"call_{i}", "type": "function",
                                      "function": {"name": tool, "arguments": ARGUMENTS}}]
            finish = "tool_calls"
        elif _wants_refusal(request):
            message["refusal"] = "I can't help with that."
        else:
            message["content"] = _reply_text(request) + (f" {i}" if i else "")
        choice: dict[str, Any] = {"index": i, "message": message, "finish_reason": finish, "logprobs": None}
        if request.get("logprobs"):
            choice["logprobs"] = _logprobs("ok", int(request.get("top_logprobs") or 0))
        choices.append(choice)
    return orjson.dumps({"id": "chatcmpl-echo", "object": "chat.completion", "created": 0,
                         "model": request.get("model"), "choices": choices, "usage": OPENAI_USAGE})


def openai_stream(request: dict[str, Any]) -> bytes:
    tool = _forced_tool(request)
    head = {"id": "chatcmpl-echo", "object": "chat.completion.chunk", "created": 0, "model": request.get("model")}

    def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    events = [chunk({"role": "assistant", "content": ""})]
    if tool is not None:
        events.append(chunk({"tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                                             "function": {"name": tool, "arguments": ""}}]}))
        events += [chunk({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
                   for piece in (ARGUMENTS[:9], ARGUMENTS[9:])]
        events.append(chunk({}, "tool_calls"))
    else:
        text = _reply_text(request)
        top = int(request.get("top_logprobs") or 0)
        for piece in (text[:1], text[1:]):
            events.append(chunk({"content": piece}, logprobs=_logprobs(piece, top) if request.get("logprobs") else None))
        events.append(chunk({}, "stop"))
    if (request.get("stream_options") or {}).get("include_usage"):
        events.append({**head, "choices": [], "usage": OPENAI_USAGE})
    return b"".join(b"data: " + orjson.dumps(event) + b"\n\n" for event in events) + b"data: [DONE]\n\n"


def anthropic_answer(request: dict[str, Any]) -> bytes:
    tool = _forced_tool(request)
    if tool is not None:
        content: list[dict[str, Any]] = [{"type": "tool_use", "id": "toolu_0", "name": tool,
                                          "input": orjson.loads(ARGUMENTS)}]
        stop = "tool_use"
    else:
        content, stop = [{"type": "text", "text": _reply_text(request)}], "end_turn"
    return orjson.dumps({"id": "msg_echo", "type": "message", "role": "assistant", "model": request.get("model"),
                         "content": content, "stop_reason": stop, "stop_sequence": None, "usage": ANTHROPIC_USAGE})


def anthropic_stream(request: dict[str, Any]) -> bytes:
    tool = _forced_tool(request)
    message: dict[str, Any] = {"id": "msg_echo", "type": "message", "role": "assistant", "model": request.get("model"), "content": [],
               "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": 8, "cache_read_input_tokens": 3, "output_tokens": 0}}
    events: list[dict[str, Any]] = [{"type": "message_start", "message": message}]
    if tool is not None:
        events.append({"type": "content_block_start", "index": 0,
                       "content_block": {"type": "tool_use", "id": "toolu_0", "name": tool, "input": {}}})
        events += [{"type": "content_block_delta", "index": 0, "delta": {"type": "input_json_delta", "partial_json": p}}
                   for p in (ARGUMENTS[:9], ARGUMENTS[9:])]
        stop = "tool_use"
    else:
        text = _reply_text(request)
        events.append({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
        events += [{"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": p}}
                   for p in (text[:1], text[1:])]
        stop = "end_turn"
    events += [{"type": "content_block_stop", "index": 0},
               {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                "usage": {"output_tokens": 2}},
               {"type": "message_stop"}]
    return b"".join(b"event: " + e["type"].encode() + b"\ndata: " + orjson.dumps(e) + b"\n\n" for e in events)


EMBEDDING_SIZE = 4


def embeddings(request: dict[str, Any]) -> bytes:
    """A vector of EMBEDDING_SIZE per input (its first value the input's length, so inputs differ)."""
    given = request.get("input")
    items = [given] if isinstance(given, str) else list(given or [])
    data = [{"object": "embedding", "index": i, "embedding": [float(len(str(item))), 0.25, -0.5, 1.0]}
            for i, item in enumerate(items)]
    tokens = sum(len(str(item).split()) for item in items)
    return orjson.dumps({"object": "list", "model": request.get("model"), "data": data,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
