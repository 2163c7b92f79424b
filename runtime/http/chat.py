"""A conversation as the pipeline reads it: a system prompt and a prompt.

The pipeline (and the response cache, the rate limiter's cost and the model's shared-prefix
reuse) knows a request by `system` and `prompt`. A chat's system messages become `system`,
so requests sharing one share its KV. One user message is the prompt as it is — the same
request a gRPC client sends, with the same answer and the same cache entry. A longer
conversation is written out as a plain transcript ending where the assistant speaks next.

The conversation itself travels too (`GenerateRequest.messages`): a model with a chat
template (a transformers instruct model) renders it with its own template, so a chat reads
to it as its authors trained it; the built-in models read the plain form.
"""

from __future__ import annotations

from collections.abc import Sequence

from runtime.http.wire import bad_request
from wire.v1 import generation_pb2

SPEAKERS = {"user": "User", "assistant": "Assistant"}


def render(system_parts: Sequence[str], turns: Sequence[tuple[str, str]]) -> tuple[str, str]:
    """(system, prompt) for a conversation of (role, text) turns, roles user|assistant."""
    system = "\n\n".join(part for part in system_parts if part)
    if not turns:
        raise bad_request("messages: at least one user or assistant message is required")
    if len(turns) == 1 and turns[0][0] == "user":
        return system, turns[0][1]
    lines = [f"{SPEAKERS[role]}: {text}" for role, text in turns]
    if turns[-1][0] == "user":
        lines.append(f"{SPEAKERS['assistant']}:")
    return system, "\n\n".join(lines)


def attach(request: generation_pb2.GenerateRequest, conversation: Sequence[tuple[str, str]]) -> None:
    """The chat's messages, in order (roles system|user|assistant), on the request."""
    for role, content in conversation:
        request.messages.add(role=role, content=content)
