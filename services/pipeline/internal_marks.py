"""Marks that only the deployment's own parts can put on a request.

The front mirrors some requests to the other side (shadow traffic: decided without
consuming rate-limit budget and never stored in the cache). A client that could claim to
be a shadow copy would skip its rate limit, so the mark is an HMAC over the request id and
a timestamp with a per-deployment secret: `x-spine-shadow: <unix seconds>.<hex digest>`.
The gateway treats a request as shadow only when the mark verifies and is fresh; anything
else a client sends in that header is ignored. Without a secret nothing is ever shadow.
"""

from __future__ import annotations

import hashlib
import hmac
import time

SHADOW_HEADER = "x-spine-shadow"
MAX_AGE_S = 60.0  # a mark older (or further in the future) than this is not honoured


def _digest(key: bytes, request_id: str, stamp: str) -> str:
    return hmac.new(key, f"shadow|{request_id}|{stamp}".encode(), hashlib.sha256).hexdigest()


def shadow_mark(key: bytes, request_id: str, now: float | None = None) -> str:
    """The header value that marks the copy of request `request_id` as shadow traffic."""
    stamp = str(int(time.time() if now is None else now))
    return f"{stamp}.{_digest(key, request_id, stamp)}"


def is_shadow(key: bytes | None, mark: str | None, request_id: str, now: float | None = None) -> bool:
    """Whether `mark` was made with `key` for this request id, recently (constant-time compare)."""
    if not key or not mark or not request_id:
        return False
    stamp, _, digest = mark.partition(".")
    if not stamp.isdigit() or len(stamp) > 12:
        return False
    if abs((time.time() if now is None else now) - int(stamp)) > MAX_AGE_S:
        return False
    return hmac.compare_digest(digest, _digest(key, request_id, stamp))
