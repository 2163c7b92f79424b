"""The `system` field of a GenerateRequest: how it is checked, joined to the prompt and echoed.

A light module (no torch): the gateway's validation, the response cache's key and the
rate limiter's cost read it as well as the model.

* Without a chat template (the embedded tiny LM, a user's backend), the model reads the
  system prompt, a blank line, then the prompt: `encode(system + SEPARATOR)` followed by
  `encode(prompt)`. The first part is what requests with the same system prompt share, so
  the engine keeps its KV once (`services.inference.model.kv_pool`).
* With a chat template (a transformers model), the system prompt is the template's system
  message (`HFTokenizer.encode_chat`); the rendered tokens the system prompt alone decides
  are the shared part (`HFTokenizer.chat_parts`), whose KV the engine stores once and
  copies into each slot that reuses it (`services.inference.model.kv_prefix`).
* Answers echo `system_digest`: the first 16 hex digits of the sha256 of its UTF-8 — which
  system prompt was applied, without sending it back on every chunk.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

SEPARATOR = "\n\n"
DIGEST_HEX = 16


@lru_cache(maxsize=256)
def system_digest(system: str) -> str:
    """16 hex digits of sha256(system); "" when there is no system prompt."""
    if not system:
        return ""
    return hashlib.sha256(system.encode()).hexdigest()[:DIGEST_HEX]


def system_error(system: str, max_chars: int) -> str | None:
    """Why `system` cannot be served (the field named, the limit given), or None."""
    if len(system) > max_chars:
        return f"system: {len(system)} characters is over the limit of {max_chars} (limits.max_system_chars)"
    return None
