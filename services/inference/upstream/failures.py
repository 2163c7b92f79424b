"""What can go wrong with one attempt at an upstream, and what each means for the next step.

Every failure has a kind; the kind says whether the same upstream may be tried again,
whether another (a fallback) may, whether it counts against the upstream's health
(outlier ejection), and the status code the client finally gets if nothing else answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import grpc


class Kind(StrEnum):
    UNREACHABLE = "unreachable"  # no connection, or it broke before an answer
    TIMEOUT = "timeout"  # no answer (or no next piece of a stream) within timeout_s
    OVERLOADED = "overloaded"  # 429: the upstream asks the spine to slow down
    FAILED = "failed"  # 5xx
    MALFORMED = "malformed"  # an answer or stream that is not its protocol's shape
    BROKEN = "broken"  # a stream that failed after its first piece reached the client
    CONTEXT = "context"  # 400: the prompt is longer than the model's context
    REFUSED = "refused"  # another 4xx about the request itself: the client's to fix
    MISCONFIGURED = "misconfigured"  # 401/403/404: the spine's credentials or model name are wrong
    BUSY = "busy"  # the upstream is at its concurrency cap (nothing was sent)
    EJECTED = "ejected"  # the upstream is cooling down after failures (nothing was sent)


# Worth trying the same upstream again, before the first byte.
RETRYABLE = frozenset({Kind.UNREACHABLE, Kind.TIMEOUT, Kind.OVERLOADED, Kind.FAILED, Kind.MALFORMED})
# Worth trying a fallback upstream (another server may well answer).
FALLS_BACK = RETRYABLE | {Kind.MISCONFIGURED, Kind.BUSY, Kind.EJECTED}
# The upstream's own fault: counted towards ejecting it (a 429 is back-pressure, not a fault).
UNHEALTHY = frozenset({Kind.UNREACHABLE, Kind.TIMEOUT, Kind.FAILED, Kind.MALFORMED, Kind.MISCONFIGURED,
                       Kind.BROKEN})

_CODES = {
    Kind.TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    Kind.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Kind.BUSY: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Kind.CONTEXT: grpc.StatusCode.INVALID_ARGUMENT,
    Kind.REFUSED: grpc.StatusCode.INVALID_ARGUMENT,
}


@dataclass
class AttemptFailure(Exception):
    """One attempt's failure: its kind, a message a person can act on, the upstream's HTTP
    status (0: none), and how long it asked the spine to wait (a 429's Retry-After).

    `message` is what the client may read: the upstream's name and what it did. `detail` is
    the operator's (the upstream's own words about the spine's credentials, a 5xx body, the
    reason a connection failed, which names its address): logged with the request id,
    never sent to a client, since it may hold the engine's address, its internals or the key
    the spine sent."""

    kind: Kind
    message: str
    status: int = 0
    retry_after_s: float | None = None
    detail: str = ""

    def __str__(self) -> str:
        return self.message

    @property
    def code(self) -> grpc.StatusCode:
        """The status the client gets when this is the last word."""
        return _CODES.get(self.kind, grpc.StatusCode.UNAVAILABLE)


def kind_for_status(status: int, message: str, context_length: bool) -> Kind:
    """The kind of an HTTP error answer."""
    if status == 429:
        return Kind.OVERLOADED
    if status >= 500 or status == 408:
        return Kind.FAILED
    if status in (401, 403, 404):
        return Kind.MISCONFIGURED
    if context_length:
        return Kind.CONTEXT
    return Kind.REFUSED


def retry_after_s(value: str | None) -> float | None:
    """A Retry-After header's seconds (a number; an HTTP date is read as 'soon': 1 s)."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return 1.0
    return max(0.0, seconds) if seconds == seconds and seconds != float("inf") else None
