"""Request ids: the caller's own when it is plain, else one made here.

Every layer (the HTTP front, the gateway, the migration's front) names a request by the same
id in its logs, trailers and records, so the id is decided in one place: a caller's
`x-request-id` is kept when it is short and plain (it may reach logs and headers, so nothing
else is kept), and a fresh one is unique across processes without a system call per request.
"""

from __future__ import annotations

import itertools
import re
import secrets

REQUEST_ID_HEADER = "x-request-id"


def safe_request_id(value: str | None) -> str:
    """Keep a caller's request id when it is short and plain; otherwise make one."""
    if value and _PLAIN_ID.fullmatch(value):
        return value
    return f"{_ID_PREFIX}{next(_ID_SEQUENCE):012x}"


# A plain id: ASCII letters, digits, '-', '_' and '.', at most 64 of them. One regex match,
# several times cheaper than a per-character check in Python; every request the migration's
# front forwards carries one. (gRPC metadata values are printable ASCII, so the per-character
# check's other letters never reached it.)
_PLAIN_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")


# Request ids: a random per-process prefix (80 bits) and a counter — unique across
# processes and restarts like a uuid4, without a system call per request.
_ID_PREFIX = secrets.token_hex(10)
_ID_SEQUENCE = itertools.count()
