"""A request's text as the model's token ids: the shared prefix apart from the prompt.

The prefix is what the engine may keep once for every request that shares it (a system
prompt's tokens), so it is split off here, the same way for every backend that can say where
it ends.
"""

from __future__ import annotations

from services.inference.model.backend import ModelBackend
from services.inference.model.chat import encode_messages
from services.pipeline.system_prompt import SEPARATOR
from wire.v1 import generation_pb2


def encode_request(backend: ModelBackend, request: generation_pb2.GenerateRequest) -> tuple[list[int], list[int]]:
    """(shared prefix, prompt) ids: with a system prompt, the chat template's where the
    backend has one (its tokens that depend on the system prompt alone are the prefix:
    `HFTokenizer.chat_parts`), else the system prompt and a blank line as the prefix the
    engine may share (`services.pipeline.system_prompt`). A chat's messages, where the backend has
    a chat template, go through it whole (`services.inference.model.chat`)."""
    if request.messages and getattr(backend, "has_chat_template", False):
        return encode_messages(backend, [{"role": m.role, "content": m.content} for m in request.messages])
    if not request.system:
        return [], backend.encode(request.prompt)
    chat_parts = getattr(backend, "encode_chat_parts", None)
    if callable(chat_parts):
        prefix, prompt = chat_parts(request.prompt, request.system)
        return list(prefix), list(prompt)
    encode_chat = getattr(backend, "encode_chat", None)
    if callable(encode_chat):
        return [], list(encode_chat(request.prompt, request.system))
    return backend.encode(request.system + SEPARATOR), backend.encode(request.prompt)
