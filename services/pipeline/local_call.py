"""A call to a component in this process, under the wire's rules.

gRPC Python has no in-process channel. A component in the spine is called directly, and
these helpers give the call what the wire would: a status code for every failure (an
exception in the component is UNKNOWN, as grpc makes of a handler's), the caller's
deadline (no time left is DEADLINE_EXCEEDED before the call; an answer after it is
DEADLINE_EXCEEDED all the same, the caller would have given up), cancellation from the
caller's own call, and metadata both ways — so a component cannot tell the layouts apart
and its callers see one behaviour: a result, or a `grpc.RpcError` with `.code()`,
`.details()` and `.trailing_metadata()`.

- `call_batch`: an operation on plain items (no message, no context: see
  `services.pipeline.batch_rpc`);
- `call_unary` / `call_stream`: a servicer's own rpc handler with a `LocalContext`;
- `call_unary_on_loop` / `call_stream_on_loop`: the same for a handler awaited on the
  caller's event loop.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Generator, Iterator, Sequence
from typing import Any, TypeVar

import grpc

from services.pipeline.interface import CallOptions, Metadata
from services.pipeline.local_context import LocalContext, LocalRpcError

Result = TypeVar("Result")
Response = TypeVar("Response")


def status_of(error: BaseException) -> grpc.StatusCode:
    """The status code an error carries (UNKNOWN when it carries none)."""
    code = getattr(error, "code", None)
    if callable(code):
        try:
            value = code()
            if isinstance(value, grpc.StatusCode):
                return value
        except Exception:
            pass
    return grpc.StatusCode.UNKNOWN


def call_batch(operation: Callable[[], Result], timeout: float | None) -> Result:
    """`operation()` (a component's operation on a batch of items, in this thread) with the
    wire's rules for a call that cannot block: no time left is DEADLINE_EXCEEDED before the
    call, an exception is UNKNOWN, and an answer that comes after the deadline is
    DEADLINE_EXCEEDED (so a step's budget holds in-process too)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    if timeout is not None and timeout <= 0:
        raise LocalRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
    try:
        result = operation()
    except grpc.RpcError:
        raise
    except Exception as error:
        raise LocalRpcError(grpc.StatusCode.UNKNOWN, f"Exception calling application: {error}") from error
    if deadline is not None and time.monotonic() >= deadline:
        raise LocalRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
    return result


def context_for(options: CallOptions) -> LocalContext:
    """The in-process twin of the servicer context a call with `options` would get."""
    deadline = None if options.timeout is None else time.monotonic() + options.timeout
    return LocalContext(options.metadata, deadline, options.parent)


def call_unary(handler: Callable[[Any, Any], Response], request: Any,
               options: CallOptions) -> tuple[Response, tuple[tuple[str, str], ...]]:
    """One unary handler call with the wire's rules: (its response, its trailing metadata),
    or the status it ended with raised as a `grpc.RpcError`."""
    context = context_for(options)
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
        return response, context.trailing_metadata()
    finally:
        context._finish()


async def call_unary_on_loop(handler: Callable[[Any, Any], Awaitable[Response]], request: Any,
                             options: CallOptions) -> tuple[Response, tuple[tuple[str, str], ...]]:
    """`call_unary` for a handler that is awaited on the caller's event loop (one that never
    blocks it: an upstream's answer, awaited on this loop's connections), same rules."""
    context = context_for(options)
    try:
        context.check_live()
        try:
            response = await handler(request, context)
        except grpc.RpcError:
            raise
        except Exception as error:
            raise LocalRpcError(grpc.StatusCode.UNKNOWN, f"Exception calling application: {error}") from error
        failure = context.result_error()
        if failure is not None:
            raise failure
        context.check_live()
        return response, context.trailing_metadata()
    finally:
        context._finish()


def call_stream(handler: Callable[[Any, Any], Iterator[Response]], request: Any,
                options: CallOptions) -> LocalStream[Response]:
    """A server-streaming handler's responses with the wire's deadline and cancel rules."""
    context = context_for(options)
    context.check_live()
    return LocalStream(handler(request, context), context)  # type: ignore[arg-type]


class _StreamEnds:
    """The wire's rules for how a local stream ends, whichever way it is read (a thread's
    `next`, a loop's `anext`): the handler's recorded error, or time run out, fails a stream
    whose generator finished; an error that is not an `RpcError` is UNKNOWN; either way the
    call's context is finished once."""

    def __init__(self, context: LocalContext) -> None:
        self._context = context
        self._ended = False

    def _finished(self) -> LocalRpcError | None:
        """The generator finished: the stream's failure, if it had one."""
        failure = self._context.result_error()
        if failure is None:
            try:
                self._context.check_live()  # a stream that ended because time ran out did not succeed
            except LocalRpcError as late:
                failure = late
        self._end()
        return failure

    def _unknown(self, error: Exception) -> LocalRpcError:
        self._end()
        return LocalRpcError(grpc.StatusCode.UNKNOWN, f"Exception iterating responses: {error}")

    def initial_metadata(self) -> Sequence[tuple[str, str]]:
        return self._context.initial_metadata()

    def trailing_metadata(self) -> Sequence[tuple[str, str]]:
        return self._context.trailing_metadata()

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            self._context._finish()


class LocalStream(_StreamEnds, Iterator[Response]):
    """Iterates a servicer's response generator with the wire's deadline and cancel rules."""

    def __init__(self, generator: Generator[Response, None, None], context: LocalContext) -> None:
        super().__init__(context)
        self._generator = generator

    def __iter__(self) -> LocalStream[Response]:
        return self

    def __next__(self) -> Response:
        if self._ended:
            raise StopIteration
        try:
            self._context.check_live()
            return next(self._generator)
        except StopIteration:
            failure = self._finished()
            if failure is not None:
                raise failure from None
            raise
        except grpc.RpcError:
            self._end()
            raise
        except Exception as error:
            raise self._unknown(error) from error

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
        self._end()
        return True


def call_stream_on_loop(handler: Callable[[Any, Any], AsyncIterator[Response]], request: Any,
                        options: CallOptions) -> LocalAsyncStream[Response]:
    """`call_stream` for a handler that is an async generator on the caller's event loop."""
    context = context_for(options)
    context.check_live()
    return LocalAsyncStream(handler(request, context), context)  # type: ignore[arg-type]


class LocalAsyncStream(_StreamEnds, AsyncIterator[Response]):
    """`LocalStream` for an async generator, read on its own event loop: the same rules,
    and `cancel` (on that loop) closes the generator at once, so its `finally` runs there."""

    def __init__(self, generator: AsyncGenerator[Response, None], context: LocalContext) -> None:
        super().__init__(context)
        self._generator = generator

    def __aiter__(self) -> LocalAsyncStream[Response]:
        return self

    async def __anext__(self) -> Response:
        if self._ended:
            raise StopAsyncIteration
        try:
            self._context.check_live()
            return await anext(self._generator)
        except StopAsyncIteration:
            failure = self._finished()
            if failure is not None:
                raise failure from None
            raise
        except grpc.RpcError:
            self._end()
            raise
        except Exception as error:
            raise self._unknown(error) from error

    async def cancel(self) -> bool:
        """Stop the stream: the servicer sees its context cancelled and its generator is closed."""
        if self._ended:
            return False
        self._context.cancel()
        try:
            await self._generator.aclose()
        except RuntimeError:  # "asynchronous generator is already running": it sees the cancel next
            pass
        self._end()
        return True


__all__ = ["LocalAsyncStream", "LocalContext", "LocalRpcError", "LocalStream", "Metadata", "call_batch",
           "call_stream", "call_stream_on_loop", "call_unary", "call_unary_on_loop", "context_for", "status_of"]
