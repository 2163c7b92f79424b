"""`POST /v1/embeddings` answered by a built-in model that can pool (`Embedder`).

The HTTP API passes the client's body as sent (`GenerateRequest.body`); an upstream engine
reads it itself. A built-in model reads it here: `input` (a string, strings, or token arrays —
the model's own ids), `encoding_format` (`float`, or `base64`: little-endian float32, which the
official SDK asks for by default) and `dimensions` (only the model's own size: a pooled vector
is not truncatable the way OpenAI's Matryoshka-trained ones are). The answer is OpenAI's shape,
so the client cannot tell a built-in embedder from an engine's.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import orjson

EMBEDDINGS_API = "openai.embeddings"


class EmbeddingRefused(ValueError):
    """The request cannot be answered as asked: the client's 400, with this message."""


@runtime_checkable
class Embedder(Protocol):
    """A backend that can embed: pooled vectors from its own model."""

    @property
    def embedding_size(self) -> int: ...

    @property
    def max_context(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def embed(self, ids: Sequence[int]) -> list[float]: ...


@dataclass(frozen=True)
class Embedded:
    body: bytes      # the OpenAI-shaped answer
    prompt_tokens: int


def inputs_of(raw: bytes, embedder: Embedder) -> list[list[int]]:
    """The token ids of each input in the client's body (strings encoded by the model's tokenizer)."""
    body = orjson.loads(raw)
    given = body.get("input") if isinstance(body, dict) else None
    if isinstance(given, str) or (isinstance(given, list) and given and all(_is_id(t) for t in given)):
        given = [given]
    if not isinstance(given, list) or not given:
        raise EmbeddingRefused("input: required, a string or a non-empty array of strings or token arrays")
    out: list[list[int]] = []
    for i, item in enumerate(given):
        if isinstance(item, str):
            ids = embedder.encode(item)
        elif isinstance(item, list) and all(_is_id(t) for t in item):
            ids = [int(t) for t in item]
        else:
            raise EmbeddingRefused(f"input[{i}]: must be a string or an array of token ids")
        if not ids:
            raise EmbeddingRefused(f"input[{i}]: empty; give at least one token of text")
        if len(ids) + 1 > embedder.max_context:
            raise EmbeddingRefused(f"input[{i}]: {len(ids)} tokens (+ BOS) exceed the model's context of "
                                   f"{embedder.max_context}")
        out.append(ids)
    return out


def embed_request(raw: bytes, model: str, embedder: Embedder) -> Embedded:
    """The OpenAI embeddings answer for the client's body `raw`, from `embedder`."""
    body: dict[str, Any] = orjson.loads(raw)
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise EmbeddingRefused(f"encoding_format: must be float or base64, got {encoding!r}")
    dimensions = body.get("dimensions")
    if dimensions is not None and dimensions != embedder.embedding_size:
        raise EmbeddingRefused(f"dimensions: the built-in model {model!r} gives vectors of "
                               f"{embedder.embedding_size} only; got {dimensions!r}")
    inputs = inputs_of(raw, embedder)
    data = [{"object": "embedding", "index": i, "embedding": _encoded(embedder.embed(ids), encoding)}
            for i, ids in enumerate(inputs)]
    tokens = sum(len(ids) for ids in inputs)
    answer = {"object": "list", "data": data, "model": model,
              "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    return Embedded(orjson.dumps(answer), tokens)


def _encoded(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
