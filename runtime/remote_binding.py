"""A component in another process: a real gRPC stub on a channel, with outlier ejection.

Calls that the component will not answer end fast: an `OutlierDetector` ejects a component
that keeps failing, and when the gateway's health watcher finds it stopped answering, the
calls already waiting on it are cancelled and end UNAVAILABLE (they would otherwise each
wait out their whole deadline on a process that is not going to answer).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from google.protobuf import descriptor as pb_descriptor

from runtime.bindings import BaseBinding, Metadata, status_of
from runtime.local_context import LocalRpcError
from runtime.sections import TlsConfig
from runtime.tls import link_channel
from services.common.outlier import Ejected, OutlierDetector
from services.pipeline.calls import Hook
from services.pipeline.verdicts import UPSTREAM_HEADER


class RemoteBinding(BaseBinding):
    """A real gRPC stub on a channel (unix socket or loopback TCP).

    With an `OutlierDetector`, a component that keeps failing is ejected: calls fail at
    once with UNAVAILABLE instead of each waiting out its timeout (see `outlier.py`)."""

    placement = "remote"

    def __init__(self, component: str, service: pb_descriptor.ServiceDescriptor, stub_class: type,
                 channel: grpc.Channel, hooks: Sequence[Hook] = (),
                 outlier: OutlierDetector | None = None) -> None:
        self.channel = channel
        self.stub = stub_class(channel)
        self.outlier = outlier
        # Calls waiting on the component, which `abandon` can cancel (only with a detector:
        # a tracked call goes through a future, which a blocking call does not).
        self._inflight: set[Any] = set()
        self._abandoned: dict[int, str] = {}
        self._lock = threading.Lock()
        super().__init__(component, service, hooks)

    def abandon(self, reason: str) -> int:
        """End every call waiting on the component with UNAVAILABLE: its health says it has
        stopped answering, and a stopped process would keep them to their deadline."""
        with self._lock:
            calls = list(self._inflight)
            self._inflight.clear()
            for call in calls:
                self._abandoned[id(call)] = reason
        for call in calls:
            call.cancel()
        return len(calls)

    def _track(self, call: Any) -> None:
        with self._lock:
            self._inflight.add(call)

    def _untrack(self, call: Any) -> str | None:
        """Forget a finished call; why it was abandoned, if it was."""
        with self._lock:
            self._inflight.discard(call)
            return self._abandoned.pop(id(call), None)

    def _gone(self, reason: str) -> Ejected:
        return Ejected(f"{self.component} stopped answering ({reason}); the call was cancelled")

    def _admit(self, tokens: list[Any]) -> None:
        if self.outlier is not None:
            try:
                self.outlier.admit()
            except grpc.RpcError:
                self._end(tokens, grpc.StatusCode.UNAVAILABLE)
                raise

    def _record(self, code: grpc.StatusCode, timeout: float | None, error: BaseException | None = None) -> None:
        if self.outlier is not None:
            self.outlier.record(grpc.StatusCode.OK if upstreams_fault(error) else code, timeout)

    def _make_method(self, method: pb_descriptor.MethodDescriptor) -> Callable[..., Any]:
        multicallable = getattr(self.stub, method.name)
        name = method.name
        if method.server_streaming:
            def call_stream(request: Any, timeout: float | None = None, metadata: Metadata | None = None,
                            parent: Any | None = None, **kwargs: Any) -> Any:
                tokens, md = self._begin(name, metadata)
                self._admit(tokens)
                call = multicallable(request, timeout=timeout, metadata=md or None, **kwargs)
                if parent is not None:
                    parent.add_callback(call.cancel)
                if self.outlier is not None:
                    self._track(call)

                def ended(code: grpc.StatusCode, error: BaseException | None = None) -> str | None:
                    self._record(code, timeout, error)
                    self._end(tokens, code)
                    return self._untrack(call)
                return _RemoteStream(call, ended, self._gone)
            return call_stream

        def call_unary(request: Any, timeout: float | None = None, metadata: Metadata | None = None,
                       parent: Any | None = None, trailing_out: list[tuple[str, str]] | None = None,
                       **kwargs: Any) -> Any:
            tokens, md = self._begin(name, metadata)
            self._admit(tokens)
            code = grpc.StatusCode.OK
            future = None
            failure: BaseException | None = None
            try:
                if parent is None and trailing_out is None and self.outlier is None:
                    return multicallable(request, timeout=timeout, metadata=md or None, **kwargs)
                future = multicallable.future(request, timeout=timeout, metadata=md or None, **kwargs)
                if self.outlier is not None:
                    self._track(future)
                if parent is not None:
                    parent.add_callback(future.cancel)
                response = future.result()
                if trailing_out is not None:
                    trailing_out.extend(future.trailing_metadata() or ())
                return response
            except grpc.RpcError as error:
                code, failure = status_of(error), error
                raise
            except grpc.FutureCancelledError as error:
                code = grpc.StatusCode.CANCELLED
                reason = self._untrack(future) if future is not None else None
                if reason is not None:
                    code = grpc.StatusCode.UNAVAILABLE
                    raise self._gone(reason) from error
                raise LocalRpcError(code, "Cancelled by the caller") from error
            finally:
                if future is not None:
                    self._untrack(future)
                self._record(code, timeout, failure)
                self._end(tokens, code)
        return call_unary

    def _make_plain(self, method: pb_descriptor.MethodDescriptor) -> Callable[..., Any]:
        multicallable = getattr(self.stub, method.name)

        def call(request: Any, timeout: float | None, metadata: Metadata | None) -> Any:
            if self.outlier is None:
                return multicallable(request, timeout=timeout, metadata=metadata or None)
            self.outlier.admit()
            code = grpc.StatusCode.OK
            future = multicallable.future(request, timeout=timeout, metadata=metadata or None)
            self._track(future)
            try:
                return future.result()
            except grpc.RpcError as error:
                code = status_of(error)
                raise
            except grpc.FutureCancelledError as error:
                code = grpc.StatusCode.UNAVAILABLE
                raise self._gone(self._untrack(future) or "cancelled") from error
            finally:
                self._untrack(future)
                self._record(code, timeout)
        return call

    def close(self) -> None:
        self.channel.close()


class _RemoteStream:
    """A server-streaming call that reports its final status to the hooks once; a stream
    abandoned because the component stopped answering ends UNAVAILABLE, not CANCELLED."""

    def __init__(self, call: Any, on_end: Callable[..., str | None],
                 gone: Callable[[str], grpc.RpcError]) -> None:
        self._call = call
        self._on_end = on_end
        self._gone = gone
        self._ended = False

    def __iter__(self) -> _RemoteStream:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._call)
        except StopIteration:
            self._end(grpc.StatusCode.OK)
            raise
        except grpc.RpcError as error:
            reason = self._end(status_of(error), error)
            if reason is not None:
                raise self._gone(reason) from error
            raise

    def cancel(self) -> bool:
        self._end(grpc.StatusCode.CANCELLED)
        return bool(self._call.cancel())

    def initial_metadata(self) -> Any:
        """What the servicer sent before its first message (available once one has arrived)."""
        return self._call.initial_metadata()

    def trailing_metadata(self) -> Any:
        return self._call.trailing_metadata()

    def _end(self, code: grpc.StatusCode, error: BaseException | None = None) -> str | None:
        if self._ended:
            return None
        self._ended = True
        return self._on_end(code, error)


def upstreams_fault(error: BaseException | None) -> bool:
    """An error whose trailers name the upstream server that failed (`x-spine-upstream`): the
    component answered — its upstream did not — so it is no failure of the component's: a
    flaky upstream must not eject the inference process that reports it (every model with it)."""
    trailing = getattr(error, "trailing_metadata", None) if error is not None else None
    if trailing is None:
        return False
    try:
        return any(key == UPSTREAM_HEADER for key, _ in trailing() or ())
    except Exception:  # a call that never got its trailers
        return False


def remote_channel(address: str, max_message_bytes: int, tls: TlsConfig | None = None) -> grpc.Channel:
    """A channel to an internal link: a unix socket (plaintext), or TCP — mTLS with this
    process's certificate when it has `tls` (a layered child behind a Kubernetes Service)."""
    return link_channel(address, tls, options=[
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.enable_retries", 0),
        # A restarted child is back within a second; the default backoff (1 s, growing to
        # 120 s) would keep the link down long after the supervisor has brought it back.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ])
