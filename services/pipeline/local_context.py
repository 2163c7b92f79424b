"""A call inside this process: what its callee reads of it, and the error it raises.

gRPC Python has no in-process channel. A component in the spine is called directly with a
`LocalCall` — the caller's metadata, deadline and cancellation, nothing of the wire — and
answers with values or raises a `LocalRpcError`, the twin of the error a real stub raises,
so its callers see one behaviour in both layouts. `LocalContext` adds the servicer
context's other half for the one rpc handler still called in-process (the HTTP API's call
of the Gateway).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from services.pipeline.limits import NO_DEADLINE_S

Metadata = Sequence[tuple[str, str]]
CallMetadata = Sequence[tuple[str, str | bytes]]  # what a call sends: a `-bin` key carries bytes


class LocalRpcError(grpc.RpcError):
    """The in-process twin of the error a real stub raises."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: Metadata = ()) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details
        self._trailing = tuple(trailing)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Any:
        return self._trailing

    def initial_metadata(self) -> Any:
        return ()


# The status a request's record takes when its HTTP client stopped reading the stream.
SLOW_READER = "SLOW_READER"


class LocalCall:
    """A call made inside this process, as its callee sees it: what the caller sent, how long
    it waits, and whether it is still there — the four things a model reads of a gRPC
    context (`invocation_metadata`, `time_remaining`, `is_active`, `add_callback`), with no
    wire to act out: the callee answers with values and raises `LocalRpcError`.

    Cancellation and deadlines flow from a parent (the caller's own call), so a client that
    goes away stops in-process work just as it would stop a remote call: the call registers
    its `cancel` as a callback of the parent, so the callee's own callbacks run the moment
    the caller's call ends, even while the callee waits on something.

    Both are taken from the parent once, not asked of it on every check: its deadline is
    folded into this one at the start, and its end arrives through that callback. Why: a
    stream's callee checks `is_active` and `time_remaining` for every chunk, and asking a
    gRPC parent each time (a lock, a clock, a few calls) cost more per chunk than the rest
    of the in-process hop. gRPC runs a call's callbacks once no operation of it is pending,
    and the parent's handler thread — the one reading this call — has none pending while it
    reads, so a cancel reaches it by the next chunk just as a check would have seen it.

    `clock` is what deadlines are read on (`time.monotonic`; a test moves its own instead of
    sleeping past one).
    """

    def __init__(
        self,
        metadata: CallMetadata = (),
        deadline: float | None = None,
        parent: Any | None = None,
        arrived: float | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._metadata = tuple(metadata)
        # When the request reached the process (time.perf_counter()), where a front read it
        # before the call began (the HTTP API): its time outside the model counts from there.
        self.arrived = arrived
        self._clock = clock
        self._deadline = _earlier(deadline, _deadline_of(parent, clock))  # seconds on `clock`
        self._cancelled = False
        self.cancelled_as = ""  # the status `cancel` was given
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._done = False
        if parent is not None and not parent.add_callback(self.cancel):
            self.cancel()  # the caller's call has already ended

    # -- what callees read --------------------------------------------------------
    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - self._clock())

    def is_active(self) -> bool:
        if self._cancelled or self._done:
            return False
        return self._deadline is None or self._clock() < self._deadline

    def add_callback(self, callback: Callable[[], None]) -> bool:
        with self._lock:
            if self._done:
                return False
            self._callbacks.append(callback)
        return True

    # -- what the caller does -----------------------------------------------------
    def cancel(self, status: str = "CANCELLED") -> None:
        """End the call; `status` is what the request's record says of it (`SLOW_READER`:
        the HTTP API gave up on a client that stopped reading its stream)."""
        if not self._cancelled:
            self.cancelled_as = status
        self._cancelled = True
        self.finish()

    def check_live(self) -> None:
        """Raise the status the wire would give a caller whose call can no longer run."""
        if self._cancelled:
            raise LocalRpcError(grpc.StatusCode.CANCELLED, "Locally cancelled by the caller")
        if self._deadline is not None and self._clock() >= self._deadline:
            raise LocalRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    def finish(self) -> None:
        """The call is over: its callbacks run once (a late `add_callback` is refused)."""
        with self._lock:
            if self._done:
                return
            self._done = True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # a callback must not break the caller, as on the wire
                pass


class LocalContext(LocalCall):
    """A `grpc.ServicerContext` stand-in: a `LocalCall` with the servicer context's other
    half (abort, metadata frames), for a servicer whose rpc handler is called in
    this process — the HTTP API calling the Gateway's. A component in this process is
    called through its interface instead, with a `LocalCall`."""

    # Made as a `LocalCall` is; its metadata frames start empty (tuples, replaced, never changed).
    _trailing: tuple[tuple[str, str], ...] = ()
    _initial: tuple[tuple[str, str], ...] = ()

    def peer(self) -> str:
        return "local"

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        if code == grpc.StatusCode.OK:
            raise ValueError("abort() needs a non-OK status code")
        raise LocalRpcError(code, details, self._trailing)

    def abort_with_status(self, status: Any) -> None:
        self.abort(status.code, status.details)

    def set_trailing_metadata(self, metadata: Metadata) -> None:
        self._trailing = tuple(metadata)

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailing

    def send_initial_metadata(self, metadata: Metadata) -> None:
        """Initial metadata has no frame in-process: kept for the caller's `initial_metadata()`."""
        self._initial = tuple(metadata)

    def initial_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._initial

    def set_compression(self, compression: Any) -> None:
        """Nothing is compressed in-process."""


def _deadline_of(parent: Any | None, clock: Callable[[], float]) -> float | None:
    """The parent's deadline on `clock` (None: it has none, or there is no parent)."""
    if parent is None:
        return None
    left: float | None = parent.time_remaining()
    if left is None or left > NO_DEADLINE_S:
        return None
    return clock() + max(0.0, left)


def _earlier(first: float | None, second: float | None) -> float | None:
    if first is None:
        return second
    return first if second is None else min(first, second)
