"""What the Envoy-protocol adapters share, in both directions.

Serving Envoy's APIs, an adapter asks the component through a `Caller`: `call(method,
request)` runs one of the component's own rpcs (its batch rpc, `ShouldRateLimit`) wherever
the component is placed now, and raises `grpc.RpcError` as the wire would.

Speaking Envoy's protocol to a service the team already runs, an adapter is a stub with the
component's own call shape: each rpc is a `Unary` (`rpc(request, timeout=, metadata=)` and
`rpc.future(...)`) that translates the call, so the runtime's remote binding (hooks,
outlier ejection) wraps it like any stub. A verdict it has to raise is a `StatusError`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import grpc

from services.common import status_code
from services.pipeline.batch_rpc import StatusError


class Caller(Protocol):
    """One of the component's rpcs by name; raises grpc.RpcError like a stub."""

    def __call__(self, method: str, request: Any) -> Any: ...


Metadata = Sequence[tuple[str, str]] | None
Translated = Callable[[Any, float | None, Metadata], Any]


class _Done:
    """A future that is already resolved (the translated call ran in the caller's thread)."""

    def __init__(self, result: Any = None, error: BaseException | None = None) -> None:
        self._result = result
        self._error = error

    def result(self, timeout: float | None = None) -> Any:
        if self._error is not None:
            raise self._error
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._error

    def cancel(self) -> bool:
        return False

    def done(self) -> bool:
        return True

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()


class Unary:
    """A translated unary rpc with a generated stub's call shape."""

    def __init__(self, translated: Translated) -> None:
        self._translated = translated

    def __call__(self, request: Any, timeout: float | None = None, metadata: Metadata = None, **_: Any) -> Any:
        return self._translated(request, timeout, metadata)

    def future(self, request: Any, timeout: float | None = None, metadata: Metadata = None, **_: Any) -> _Done:
        try:
            return _Done(self._translated(request, timeout, metadata))
        except grpc.RpcError as error:
            return _Done(error=error)


def one_answer(result: Any) -> Any:
    """The response of a batch-of-one's result, or its item status raised as the call's."""
    if result.status.code:
        raise StatusError(status_code(result.status.code), result.status.message)
    return result.response


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
