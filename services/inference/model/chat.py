"""Chat messages (system / user / assistant) as the token ids a model reads.

What the HTTP chat endpoints (OpenAI `/v1/chat/completions`, Anthropic `/v1/messages`) hand
the model, in one place:

    prefix_ids, prompt_ids = encode_messages(backend, [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"},
    ])
    GenerationRequest(prompt_ids=prompt_ids, prefix_ids=prefix_ids, max_tokens=...)

* A backend with a chat template (a transformers instruct model: `HFBackend`) renders the
  whole conversation with the model's own template, ready for the assistant's turn
  (`add_generation_prompt`); the start of it that the system messages alone decide is the
  prefix (`HFTokenizer.messages_parts`), whose KV its engine keeps once (`kv_prefix`).
* Any other backend (the built-in tiny LMs, a user's) reads it plainly, as the gRPC
  `system` field is read: the system messages, a blank line, then the other messages'
  contents joined by blank lines. A conversation of one system and one user message
  therefore gets exactly the tokens of `GenerateRequest(system=..., prompt=...)`, and the
  system part is the prefix the engine may share between requests.

The engine puts BOS first; neither form includes it. Answers end at the model's stop tokens
(`HFTokenizer.stop_ids`: EOS and the generation config's, e.g. `<|im_end|>`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from services.pipeline.system_prompt import SEPARATOR

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


def check_messages(messages: Iterable[Mapping[str, Any] | ChatMessage]) -> list[ChatMessage]:
    """The messages as ChatMessages; ValueError naming the message and field that is wrong."""
    checked: list[ChatMessage] = []
    for index, message in enumerate(messages):
        role: Any
        content: Any
        if isinstance(message, ChatMessage):
            role, content = message.role, message.content
        elif isinstance(message, Mapping):
            role, content = message.get("role"), message.get("content")
        else:
            raise ValueError(f"messages[{index}]: expected an object with role and content, got "
                             f"{type(message).__name__}")
        if role not in ROLES:
            raise ValueError(f"messages[{index}].role: expected one of {', '.join(ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"messages[{index}].content: expected a string, got {type(content).__name__}")
        checked.append(ChatMessage(role, content))
    if not any(m.role != "system" for m in checked):
        raise ValueError("messages: at least one user or assistant message is required")
    return checked


def plain_parts(messages: Iterable[Mapping[str, Any] | ChatMessage]) -> tuple[str, str]:
    """(system, prompt) as a model without a chat template reads them (see the module docstring)."""
    checked = check_messages(messages)
    system = SEPARATOR.join(m.content for m in checked if m.role == "system")
    prompt = SEPARATOR.join(m.content for m in checked if m.role != "system")
    return system, prompt


def encode_messages(backend: Any, messages: Iterable[Mapping[str, Any] | ChatMessage]) -> tuple[list[int], list[int]]:
    """(prefix_ids, prompt_ids) for a GenerationRequest: through the backend's own chat template
    where it has one (`backend.encode_messages`), else plain (`plain_parts`)."""
    checked = check_messages(messages)
    if getattr(backend, "has_chat_template", False):
        parts = getattr(backend, "encode_messages_parts", None)
        if callable(parts):
            prefix, prompt = parts(checked)
            return list(prefix), list(prompt)
        render = getattr(backend, "encode_messages", None)
        if callable(render):
            return [], list(render(checked))
    system, prompt = plain_parts(checked)
    return (backend.encode(system + SEPARATOR) if system else []), list(backend.encode(prompt))
