"""Bindings: a component plus a placement becomes a client with the stub's call shape.

`RemoteBinding` is a real gRPC stub on a channel. `LocalBinding` calls the servicer
method directly with the request message — no serialization, no thread hop — through a
`LocalContext` that honours the same status codes, deadlines, cancellation and metadata
as the wire (gRPC Python has no in-process channel of its own). Both run the same hooks,
so the two layouts can be compared span by span.

Callers see one behaviour: a method returns the response (or an iterator of responses
for server streaming) or raises `grpc.RpcError` with `.code()`, `.details()` and
`.trailing_metadata()`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any, Protocol

import grpc
from google.protobuf import descriptor as pb_descriptor

from spine.runtime.outlier import OutlierDetector

Metadata = Sequence[tuple[str, str]]


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


class LocalContext:
    """A `grpc.ServicerContext` stand-in for in-process calls.

    Cancellation and deadlines flow from a parent context (the caller's own RPC), so a
    client that goes away stops in-process work just as it would stop a remote call: the
    binding registers `cancel` as a callback of the parent, so the servicer's own callbacks
    run the moment the caller's RPC ends, even while the servicer waits on something.
    """

    def __init__(
        self,
        metadata: Metadata = (),
        deadline: float | None = None,
        parent: Any | None = None,
    ) -> None:
        self._metadata = tuple(metadata)
        self._deadline = deadline  # time.monotonic() seconds
        self._parent = parent
        self._cancelled = False
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self._trailing: tuple[tuple[str, str], ...] = ()
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._done = False

    # -- what servicers use -------------------------------------------------------
    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return "local"

    def time_remaining(self) -> float | None:
        own = None if self._deadline is None else max(0.0, self._deadline - time.monotonic())
        parent = self._parent.time_remaining() if self._parent is not None else None
        if own is None:
            return parent
        return own if parent is None else min(own, parent)

    def is_active(self) -> bool:
        if self._cancelled or self._done:
            return False
        if self._deadline is not None and time.monotonic() >= self._deadline:
            return False
        return self._parent is None or bool(self._parent.is_active())

    def add_callback(self, callback: Callable[[], None]) -> bool:
        with self._lock:
            if self._done:
                return False
            self._callbacks.append(callback)
        return True

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        if code == grpc.StatusCode.OK:
            raise ValueError("abort() needs a non-OK status code")
        self._code, self._details = code, details
        raise LocalRpcError(code, details, self._trailing)

    def abort_with_status(self, status: Any) -> None:
        self.abort(status.code, status.details)

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def set_trailing_metadata(self, metadata: Metadata) -> None:
        self._trailing = tuple(metadata)

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailing

    def send_initial_metadata(self, metadata: Metadata) -> None:
        """Initial metadata has no separate frame in-process; nothing to send."""

    def set_compression(self, compression: Any) -> None:
        """Nothing is compressed in-process."""

    def cancel(self) -> None:
        self._cancelled = True
        self._finish()

    # -- what the binding uses ----------------------------------------------------
    def check_live(self) -> None:
        """Raise the status the wire would give a caller whose call can no longer run."""
        if self._cancelled or (self._parent is not None and not self._parent.is_active()):
            raise LocalRpcError(grpc.StatusCode.CANCELLED, "Locally cancelled by the caller")
        if self._deadline is not None and time.monotonic() >= self._deadline:
            raise LocalRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    def result_error(self) -> LocalRpcError | None:
        """A non-OK code set with set_code() ends the call with that status."""
        if self._code is not None and self._code != grpc.StatusCode.OK:
            return LocalRpcError(self._code, self._details, self._trailing)
        return None

    def _finish(self) -> None:
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


class BindingHook(Protocol):
    """Runs around every call of every binding (timings, spans).

    `before` may return extra metadata to send (trace context); its return value of
    `begin` is handed back to `end`.
    """

    def begin(self, component: str, method: str, metadata: list[tuple[str, str]]) -> Any: ...

    def end(self, token: Any, code: grpc.StatusCode) -> None: ...


def _status_of(error: BaseException) -> grpc.StatusCode:
    code = getattr(error, "code", None)
    if callable(code):
        try:
            value = code()
            if isinstance(value, grpc.StatusCode):
                return value
        except Exception:
            pass
    return grpc.StatusCode.UNKNOWN


class _Binding:
    """What both bindings share: the method table and the hooks.

    Each rpc is an attribute with the stub's call shape that runs the hooks around the
    call. `invoke` makes the same call without them: the pipeline runs the hooks itself,
    once per request, around a batch call that serves many requests."""

    placement = "?"

    def __init__(self, component: str, service: pb_descriptor.ServiceDescriptor, hooks: Sequence[BindingHook]):
        self.component = component
        self.service = service
        self.hooks = list(hooks)
        self._plain: dict[str, Callable[..., Any]] = {}
        for method in service.methods:
            setattr(self, method.name, self._make_method(method))
            if not method.server_streaming:
                self._plain[method.name] = self._make_plain(method)

    def _make_method(self, method: pb_descriptor.MethodDescriptor) -> Callable[..., Any]:
        raise NotImplementedError

    def _make_plain(self, method: pb_descriptor.MethodDescriptor) -> Callable[..., Any]:
        raise NotImplementedError

    def invoke(self, method: str, request: Any, *, timeout: float | None = None,
               metadata: Metadata | None = None) -> Any:
        """A unary call without the hooks; raises `grpc.RpcError` as the wire would."""
        return self._plain[method](request, timeout, metadata)

    def _begin(self, method: str, metadata: Metadata | None) -> tuple[list[Any], list[tuple[str, str]]]:
        md = list(metadata or ())
        tokens = [hook.begin(self.component, method, md) for hook in self.hooks]
        return tokens, md

    def _end(self, tokens: list[Any], code: grpc.StatusCode) -> None:
        for hook, token in zip(reversed(self.hooks), reversed(tokens), strict=True):
            hook.end(token, code)

    def close(self) -> None:
        """Release what the binding holds (a channel)."""


class LocalBinding(_Binding):
    """Calls the servicer in the caller's thread with a `LocalContext`."""

    placement = "local"

    def __init__(self, component: str, service: pb_descriptor.ServiceDescriptor, servicer: Any,
                 hooks: Sequence[BindingHook] = ()) -> None:
        self.servicer = servicer
        super().__init__(component, service, hooks)

    def _make_method(self, method: pb_descriptor.MethodDescriptor) -> Callable[..., Any]:
        handler = getattr(self.servicer, method.name)
        name = method.name
        if method.server_streaming:
            def call_stream(request: Any, timeout: float | None = None, metadata: Metadata | None = None,
                            parent: Any | None = None, **_: Any) -> LocalStream:
                tokens, md = self._begin(name, metadata)
                context = _context(md, timeout, parent)
                try:
                    context.check_live()
                except grpc.RpcError as error:
                    self._end(tokens, _status_of(error))
                    raise
                return LocalStream(handler(request, context), context, lambda code: self._end(tokens, code))
            return call_stream

        def call_unary(request: Any, timeout: float | None = None, metadata: Metadata | None = None,
                       parent: Any | None = None, trailing_out: list[tuple[str, str]] | None = None,
                       **_: Any) -> Any:
            tokens, md = self._begin(name, metadata)
            code = grpc.StatusCode.OK
            try:
                return _call_local(handler, request, _context(md, timeout, parent), trailing_out)
            except grpc.RpcError as error:
                code = _status_of(error)
                raise
            finally:
                self._end(tokens, code)
        return call_unary

    def _make_plain(self, method: pb_descriptor.MethodDescriptor) -> Callable[..., Any]:
        handler = getattr(self.servicer, method.name)

        def call(request: Any, timeout: float | None, metadata: Metadata | None) -> Any:
            return _call_local(handler, request, _context(metadata or (), timeout, None), None)
        return call


def _call_local(handler: Callable[[Any, Any], Any], request: Any, context: LocalContext,
                trailing_out: list[tuple[str, str]] | None) -> Any:
    """One unary handler call with the wire's rules: status codes, deadline, cancellation."""
    try:
        context.check_live()
        try:
            response = handler(request, context)
        except grpc.RpcError:
            raise
        except Exception as error:  # what grpc does with an exception in a handler
            raise LocalRpcError(grpc.StatusCode.UNKNOWN, f"Exception calling application: {error}") from error
        failure = context.result_error()
        if failure is not None:
            raise failure
        context.check_live()  # the caller would have given up by now
        if trailing_out is not None:
            trailing_out.extend(context.trailing_metadata())
        return response
    finally:
        context._finish()


def _context(metadata: Metadata, timeout: float | None, parent: Any | None) -> LocalContext:
    deadline = None if timeout is None else time.monotonic() + timeout
    context = LocalContext(metadata, deadline, parent)
    if parent is not None and not parent.add_callback(context.cancel):
        context.cancel()  # the caller's RPC has already ended
    return context


class LocalStream:
    """Iterates a servicer's response generator with the wire's deadline and cancel rules."""

    def __init__(self, generator: Generator[Any, None, None], context: LocalContext,
                 on_end: Callable[[grpc.StatusCode], None]) -> None:
        self._generator = generator
        self._context = context
        self._on_end = on_end
        self._ended = False

    def __iter__(self) -> LocalStream:
        return self

    def __next__(self) -> Any:
        if self._ended:
            raise StopIteration
        try:
            self._context.check_live()
            item = next(self._generator)
            return item
        except StopIteration:
            failure = self._context.result_error()
            if failure is None:
                try:
                    self._context.check_live()  # a stream that ended because time ran out did not succeed
                except LocalRpcError as late:
                    failure = late
            if failure is not None:
                self._end(failure.code())
                raise failure from None
            self._end(grpc.StatusCode.OK)
            raise
        except grpc.RpcError as error:
            self._end(_status_of(error))
            raise
        except Exception as error:
            self._end(grpc.StatusCode.UNKNOWN)
            raise LocalRpcError(grpc.StatusCode.UNKNOWN, f"Exception iterating responses: {error}") from error

    def cancel(self) -> bool:
        """Stop the stream, from any thread, as `grpc.Call.cancel` does: the servicer's
        callbacks run and it sees `is_active()` turn False; its generator is closed (its
        `finally` runs) unless another thread is inside it right now, in which case that
        thread sees the cancel at its next check."""
        if self._ended:
            return False
        self._context.cancel()
        try:
            self._generator.close()
        except ValueError:  # "generator already executing" in the reading thread
            pass
        self._end(grpc.StatusCode.CANCELLED)
        return True

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._context.trailing_metadata()

    def _end(self, code: grpc.StatusCode) -> None:
        if not self._ended:
            self._ended = True
            self._context._finish()
            self._on_end(code)


class RemoteBinding(_Binding):
    """A real gRPC stub on a channel (unix socket or loopback TCP).

    With an `OutlierDetector`, a component that keeps failing is ejected: calls fail at
    once with UNAVAILABLE instead of each waiting out its timeout (see `outlier.py`)."""

    placement = "remote"

    def __init__(self, component: str, service: pb_descriptor.ServiceDescriptor, stub_class: type,
                 channel: grpc.Channel, hooks: Sequence[BindingHook] = (),
                 outlier: OutlierDetector | None = None) -> None:
        self.channel = channel
        self.stub = stub_class(channel)
        self.outlier = outlier
        super().__init__(component, service, hooks)

    def _admit(self, tokens: list[Any]) -> None:
        if self.outlier is not None:
            try:
                self.outlier.admit()
            except grpc.RpcError:
                self._end(tokens, grpc.StatusCode.UNAVAILABLE)
                raise

    def _record(self, code: grpc.StatusCode, timeout: float | None) -> None:
        if self.outlier is not None:
            self.outlier.record(code, timeout)

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

                def ended(code: grpc.StatusCode) -> None:
                    self._record(code, timeout)
                    self._end(tokens, code)
                return _RemoteStream(call, ended)
            return call_stream

        def call_unary(request: Any, timeout: float | None = None, metadata: Metadata | None = None,
                       parent: Any | None = None, trailing_out: list[tuple[str, str]] | None = None,
                       **kwargs: Any) -> Any:
            tokens, md = self._begin(name, metadata)
            self._admit(tokens)
            code = grpc.StatusCode.OK
            try:
                if parent is None and trailing_out is None:
                    return multicallable(request, timeout=timeout, metadata=md or None, **kwargs)
                future = multicallable.future(request, timeout=timeout, metadata=md or None, **kwargs)
                if parent is not None:
                    parent.add_callback(future.cancel)
                response = future.result()
                if trailing_out is not None:
                    trailing_out.extend(future.trailing_metadata() or ())
                return response
            except grpc.RpcError as error:
                code = _status_of(error)
                raise
            except grpc.FutureCancelledError as error:
                code = grpc.StatusCode.CANCELLED
                raise LocalRpcError(code, "Cancelled by the caller") from error
            finally:
                self._record(code, timeout)
                self._end(tokens, code)
        return call_unary

    def _make_plain(self, method: pb_descriptor.MethodDescriptor) -> Callable[..., Any]:
        multicallable = getattr(self.stub, method.name)

        def call(request: Any, timeout: float | None, metadata: Metadata | None) -> Any:
            if self.outlier is not None:
                self.outlier.admit()
            code = grpc.StatusCode.OK
            try:
                return multicallable(request, timeout=timeout, metadata=metadata or None)
            except grpc.RpcError as error:
                code = _status_of(error)
                raise
            finally:
                self._record(code, timeout)
        return call

    def close(self) -> None:
        self.channel.close()


class _RemoteStream:
    """A server-streaming call that reports its final status to the hooks once."""

    def __init__(self, call: Any, on_end: Callable[[grpc.StatusCode], None]) -> None:
        self._call = call
        self._on_end = on_end
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
            self._end(_status_of(error))
            raise

    def cancel(self) -> bool:
        self._end(grpc.StatusCode.CANCELLED)
        return bool(self._call.cancel())

    def trailing_metadata(self) -> Any:
        return self._call.trailing_metadata()

    def _end(self, code: grpc.StatusCode) -> None:
        if not self._ended:
            self._ended = True
            self._on_end(code)
