"""What the Envoy-protocol adapters share, in both directions (`services.auth.envoy_authz`,
`services.ratelimit.envoy_ratelimit`): a failed call's status, and text safe to quote in a
message or a header.
"""

from __future__ import annotations

from typing import Any

import grpc


def rpc_status(error: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    """(code, details) of a failed call, UNKNOWN when it carries none."""
    call: Any = error
    code = call.code() if callable(getattr(call, "code", None)) else grpc.StatusCode.UNKNOWN
    details = call.details() if callable(getattr(call, "details", None)) else str(error)
    return (code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN), str(details or "")


def printable(text: str, limit: int = 200) -> str:
    """`text` safe to quote in a message or a header: printable ASCII, at most `limit` characters."""
    shown = "".join(c if " " <= c <= "~" else "?" for c in text[:limit])
    return shown + ("..." if len(text) > limit else "")


def header_safe(value: str) -> bool:
    """Whether `value` can be sent as an HTTP header value unchanged (visible ASCII and spaces)."""
    return bool(value) and all(" " <= c <= "~" for c in value) and value == value.strip()
