"""Keep credentials out of logs, traces and error messages.

Two rules, both applied wherever a mapping or text leaves the process for humans to read:
- by key: a value under a key that names a secret (authorization, *token, api_key, password,
  secret, credential, cookie, ...) is replaced whatever it is;
- by shape: text that looks like a bearer credential or a JWT is replaced wherever it appears,
  because secrets also travel under innocent keys ("note": "Bearer eyJ...").
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Any

REDACTED = "[REDACTED]"

# Matched against the key lowercased with everything but letters and digits removed, so
# `X-Api-Key`, `api_key` and `apiKey` are one key. "token" only as a suffix: `access_token` and
# `authToken` are secrets, `max_tokens` and `token_count` are not.
_SECRET_KEY_PARTS = (
    "authorization",
    "password",
    "passwd",
    "secret",
    "credential",
    "cookie",
    "apikey",
    "privatekey",
)
_SECRET_KEY_SUFFIXES = ("token",)

_B64URL = r"[A-Za-z0-9_-]"
_SECRET_TEXT = re.compile(
    # `Bearer <credential>`, as in an Authorization header (RFC 6750 token68 characters).
    r"\bbearer\s+[A-Za-z0-9\-._~+/]+=*"
    # A JWT/JWS: a base64url JSON header (always starts `eyJ`), payload, optional signature.
    rf"|\beyJ{_B64URL}*\.{_B64URL}+\.{_B64URL}*"
    # Any other three long base64url parts joined by dots (opaque signed tokens).
    rf"|(?<![A-Za-z0-9_.-]){_B64URL}{{16,}}\.{_B64URL}{{16,}}\.{_B64URL}{{16,}}(?![A-Za-z0-9_-])",
    re.IGNORECASE,
)


@functools.lru_cache(maxsize=4096)
def _is_secret_name(name: str) -> bool:
    """Memoized: log records repeat the same few field names on every request."""
    flat = re.sub(r"[^a-z0-9]", "", name.lower())
    return any(part in flat for part in _SECRET_KEY_PARTS) or flat.endswith(_SECRET_KEY_SUFFIXES)


def is_secret_key(key: object) -> bool:
    """True when a key names a credential, whatever the case or separators."""
    return _is_secret_name(str(key))


# The shortest text any of the patterns can match ("eyJ.a."): shorter text is kept as is
# without running the regex (most log values — status, tenant — are that short).
_SHORTEST_SECRET = 6


def redact_text(text: str) -> str:
    """`text` with every bearer credential and JWT-looking token replaced by [REDACTED]."""
    if len(text) < _SHORTEST_SECRET:
        return text
    # Every pattern needs a dot (a JWT, an opaque signed token) or the word "bearer": text
    # with neither — request ids, tenants, most model names — skips the regex (a log line
    # ran it on five values, half the cost of writing the line).
    if "." not in text and "bearer" not in text.lower():
        return text
    return _SECRET_TEXT.sub(REDACTED, text)


def redact_value(value: Any) -> Any:
    """Strings are scrubbed by shape; mappings and sequences are walked; the rest is kept."""
    if isinstance(value, str):
        return redact_text(value)
    if value is None or isinstance(value, bool | int | float):  # before the (slow) Mapping ABC check
        return value
    if isinstance(value, Mapping):
        return redact_mapping(value)
    if isinstance(value, list | tuple):
        return [redact_value(v) for v in value]
    return value


def redact_mapping(d: Mapping[Any, Any]) -> dict[Any, Any]:
    """A copy of `d` (nested mappings and lists too) with secrets replaced by [REDACTED]."""
    return {k: REDACTED if is_secret_key(k) else redact_value(v) for k, v in d.items()}
