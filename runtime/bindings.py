"""Bindings: a component plus a placement becomes a client with the stub's call shape.

`RemoteBinding` (`remote_binding.py`) is a real gRPC stub on a channel. `LocalBinding` calls the servicer
method directly with the request message — no serialization, no thread hop — through a
`LocalContext` that honours the same status codes, deadlines, cancellation and metadata
as the wire (gRPC Python has no in-process channel of its own). Both run the same hooks,
so the two layouts can be compared span by span.

Callers see one behaviour: a method returns the response (or an iterator of responses
for server streaming) or raises `grpc.RpcError` with `.code()`, `.details()` and
`.trailing_metadata()`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from typing import Any

import grpc
from google.protobuf import descriptor as pb_descriptor

from runtime.local_context import LocalContext, LocalRpcError, Metadata
from services.pipeline.batch_rpc import BatchRpc, ItemError
from services.pipeline.calls import Hook


def status_of(error: BaseException) -> grpc.StatusCode:
    code = getattr(error, "code", None)
    if callable(code):
        try:
            value = code()
            if isinstance(value, grpc.StatusCode):
                return value
        except Exception:
            pass
    return grpc.StatusCode.UNKNOWN


class BaseBinding:
    """What both bindings share: the method table and the hooks.

    `call` makes an rpc by name with the stub's call shape, the hooks around it; the
    generated classes (`runtime.binding_classes`) write each rpc out as a method that
    calls it (`bindings["auth"].Check(request)`). `invoke` makes the same call without the
    hooks: the pipeline runs them itself, once per request, around a batch call that
    serves many requests."""

    placement = "?"

    def __init__(self, component: str, service: pb_descriptor.ServiceDescriptor, hooks: Sequence[Hook]):
        self.component = component
        self.service = service
        self.hooks = list(hooks)
        self._methods: dict[str, Callable[..., Any]] = {}
        self._plain: dict[str, Callable[..., Any]] = {}
        for method in service.methods:
            self._methods[method.name] = self._make_method(method)
            if not method.server_streaming:
                self._plain[method.name] = self._make_plain(method)

    def call(self, method: str, request: Any, timeout: float | None = None, metadata: Metadata | None = None,
             **options: Any) -> Any:
        """The rpc `method` with the hooks: its response, or for a server-streaming rpc the
        stream (iterate it, `cancel()` it, read its `trailing_metadata()`); raises
        `grpc.RpcError` as the wire would. `options`: `parent` (the caller's context, whose
        cancellation reaches the call) and, for a unary call, `trailing_out` (a list the
        answer's trailing metadata is added to)."""
        return self._methods[method](request, timeout, metadata, **options)

    def _make_method(self, method: pb_descriptor.MethodDescriptor) -> Callable[..., Any]:
        raise NotImplementedError

    def _make_plain(self, method: pb_descriptor.MethodDescriptor) -> Callable[..., Any]:
        raise NotImplementedError

    def invoke(self, method: str, request: Any, *, timeout: float | None = None,
               metadata: Metadata | None = None) -> Any:
        """A unary call without the hooks; raises `grpc.RpcError` as the wire would."""
        return self._plain[method](request, timeout, metadata)

    def call_batch(self, rpc: BatchRpc[Any, Any], items: Sequence[Any], *, timeout: float | None = None,
                   metadata: Metadata | None = None) -> list[Any | ItemError]:
        """A batch rpc on plain items, without the hooks: over the wire, its codec around `invoke`."""
        return rpc.over(self, items, timeout, metadata or ())

    def _begin(self, method: str, metadata: Metadata | None) -> tuple[list[Any], list[tuple[str, str]]]:
        md = list(metadata or ())
        tokens = [hook.begin(self.component, method, md) for hook in self.hooks]
        return tokens, md

    def _end(self, tokens: list[Any], code: grpc.StatusCode) -> None:
        for hook, token in zip(reversed(self.hooks), reversed(tokens), strict=True):
            hook.end(token, code)

    def close(self) -> None:
        """Release what the binding holds (a channel)."""


class LocalBinding(BaseBinding):
    """Calls the servicer in the caller's thread with a `LocalContext`."""

    placement = "local"

    def __init__(self, component: str, service: pb_descriptor.ServiceDescriptor, servicer: Any,
                 hooks: Sequence[Hook] = ()) -> None:
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
                    self._end(tokens, status_of(error))
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
                code = status_of(error)
                raise
            finally:
                self._end(tokens, code)
        return call_unary

    def call_batch(self, rpc: BatchRpc[Any, Any], items: Sequence[Any], *, timeout: float | None = None,
                   metadata: Metadata | None = None) -> list[Any | ItemError]:
        """The servicer's plain method on the items, in the caller's thread: no request
        message, no context (see `services.pipeline.batch_rpc`). The wire's rules that
        apply to a call that cannot block: no time left is DEADLINE_EXCEEDED before the
        call, and an exception in the servicer is UNKNOWN, as grpc makes of a handler's;
        an answer that comes after the deadline is DEADLINE_EXCEEDED all the same (the
        caller would have given up), so a stage's budget holds in-process too."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if timeout is not None and timeout <= 0:
            raise LocalRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        try:
            results = getattr(self.servicer, rpc.local)(items)
        except grpc.RpcError:
            raise
        except Exception as error:
            raise LocalRpcError(grpc.StatusCode.UNKNOWN, f"Exception calling application: {error}") from error
        if deadline is not None and time.monotonic() >= deadline:
            raise LocalRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        return results  # type: ignore[no-any-return]

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
    return LocalContext(metadata, deadline, parent)


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
            self._end(status_of(error))
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

    def initial_metadata(self) -> tuple[tuple[str, str], ...]:
        """What the servicer sent before its first chunk (`send_initial_metadata`), as a stub's call has."""
        return self._context.initial_metadata()

    def _end(self, code: grpc.StatusCode) -> None:
        if not self._ended:
            self._ended = True
            self._context._finish()
            self._on_end(code)


__all__ = ["LocalBinding", "LocalContext", "LocalRpcError", "LocalStream", "Metadata"]
