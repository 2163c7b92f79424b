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
- `call_local` / `open_stream`: a component's own operation, handed a `LocalCall` (the
  caller's metadata, deadline and cancellation) and answering with values — no servicer
  context is acted out;
- `call_local_on_loop` / `open_stream_on_loop`: the same for an operation awaited on the
  caller's event loop.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc

from services.pipeline.interface import CallOptions, Metadata
from services.pipeline.local_context import LocalCall, LocalRpcError

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


def local_call(options: CallOptions) -> LocalCall:
    """The call a component in this process is handed for a call with `options`."""
    deadline = None if options.timeout is None else time.monotonic() + options.timeout
    return LocalCall(options.metadata, deadline, options.parent)


def call_local(operation: Callable[[LocalCall], Result], options: CallOptions) -> Result:
    """`operation(call)` — a component's own operation, handed the call's deadline, metadata
    and cancellation — with the wire's rules: no time left is DEADLINE_EXCEEDED before it, an
    exception that is not a `grpc.RpcError` is UNKNOWN, an answer after the deadline is
    DEADLINE_EXCEEDED (the caller would have given up), and the call's callbacks run once
    it is over."""
    call = local_call(options)
    try:
        call.check_live()
        try:
            result = operation(call)
        except grpc.RpcError:
            raise
        except Exception as error:  # what grpc does with an exception in a handler
            raise LocalRpcError(grpc.StatusCode.UNKNOWN, f"Exception calling application: {error}") from error
        call.check_live()
        return result
    finally:
        call.finish()


async def call_local_on_loop(operation: Callable[[LocalCall], Awaitable[Result]], options: CallOptions) -> Result:
    """`call_local` for an operation awaited on the caller's event loop (one that never blocks
    it: an upstream's answer, awaited on this loop's connections), same rules."""
    call = local_call(options)
    try:
        call.check_live()
        try:
            result = await operation(call)
        except grpc.RpcError:
            raise
        except Exception as error:
            raise LocalRpcError(grpc.StatusCode.UNKNOWN, f"Exception calling application: {error}") from error
        call.check_live()
        return result
    finally:
        call.finish()


@dataclass(slots=True)
class StreamHeaders:
    """The metadata a stream goes out with, set by its producer as it learns it: `initial`
    before its first chunk (the HTTP API's headers go out with that chunk), `trailing` by
    its end. Values, where a servicer would have written them on its context."""

    initial: Metadata = ()
    trailing: Metadata = ()

    def set_initial(self, metadata: Metadata) -> None:
        self.initial = tuple(metadata)

    def set_trailing(self, metadata: Metadata) -> None:
        self.trailing = tuple(metadata)


def open_stream(chunks: Callable[[LocalCall, StreamHeaders], Iterator[Response]],
                options: CallOptions) -> LocalStream[Response]:
    """A component's stream (`chunks(call, headers)`, a generator) with the wire's deadline
    and cancel rules."""
    call = local_call(options)
    call.check_live()
    headers = StreamHeaders()
    return LocalStream(chunks(call, headers), call, headers)  # type: ignore[arg-type]


class _StreamEnds:
    """The wire's rules for how a local stream ends, whichever way it is read (a thread's
    `next`, a loop's `anext`): time run out fails a stream whose generator finished; an error
    that is not an `RpcError` is UNKNOWN; either way the call is finished once."""

    def __init__(self, call: LocalCall, headers: StreamHeaders) -> None:
        self._call = call
        self._headers = headers
        self._ended = False

    def _finished(self) -> LocalRpcError | None:
        """The generator finished: the stream's failure, if it had one."""
        failure = None
        try:
            self._call.check_live()  # a stream that ended because time ran out did not succeed
        except LocalRpcError as late:
            failure = late
        self._end()
        return failure

    def _unknown(self, error: Exception) -> LocalRpcError:
        self._end()
        return LocalRpcError(grpc.StatusCode.UNKNOWN, f"Exception iterating responses: {error}")

    def initial_metadata(self) -> Sequence[tuple[str, str]]:
        return tuple(self._headers.initial)

    def trailing_metadata(self) -> Sequence[tuple[str, str]]:
        return tuple(self._headers.trailing)

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            self._call.finish()


class LocalStream(_StreamEnds, Iterator[Response]):
    """Iterates a component's chunk generator with the wire's deadline and cancel rules."""

    def __init__(self, generator: Generator[Response, None, None], call: LocalCall, headers: StreamHeaders) -> None:
        super().__init__(call, headers)
        self._generator = generator

    def __iter__(self) -> LocalStream[Response]:
        return self

    def __next__(self) -> Response:
        if self._ended:
            raise StopIteration
        try:
            self._call.check_live()
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
        """Stop the stream, from any thread, as `grpc.Call.cancel` does: the component's
        callbacks run and it sees `is_active()` turn False; its generator is closed (its
        `finally` runs) unless another thread is inside it right now, in which case that
        thread sees the cancel at its next check."""
        if self._ended:
            return False
        self._call.cancel()
        try:
            self._generator.close()
        except ValueError:  # "generator already executing" in the reading thread
            pass
        self._end()
        return True


def open_stream_on_loop(chunks: Callable[[LocalCall, StreamHeaders], AsyncIterator[Response]],
                        options: CallOptions) -> LocalAsyncStream[Response]:
    """`open_stream` for a component's async generator, read on the caller's event loop."""
    call = local_call(options)
    call.check_live()
    headers = StreamHeaders()
    return LocalAsyncStream(chunks(call, headers), call, headers)  # type: ignore[arg-type]


class LocalAsyncStream(_StreamEnds, AsyncIterator[Response]):
    """`LocalStream` for an async generator, read on its own event loop: the same rules,
    and `cancel` (on that loop) closes the generator at once, so its `finally` runs there."""

    def __init__(self, generator: AsyncGenerator[Response, None], call: LocalCall, headers: StreamHeaders) -> None:
        super().__init__(call, headers)
        self._generator = generator

    def __aiter__(self) -> LocalAsyncStream[Response]:
        return self

    async def __anext__(self) -> Response:
        if self._ended:
            raise StopAsyncIteration
        try:
            self._call.check_live()
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
        """Stop the stream: the component sees its call cancelled and its generator is closed."""
        if self._ended:
            return False
        self._call.cancel()
        try:
            await self._generator.aclose()
        except RuntimeError:  # "asynchronous generator is already running": it sees the cancel next
            pass
        self._end()
        return True


__all__ = ["LocalAsyncStream", "LocalCall", "LocalRpcError", "LocalStream", "Metadata", "StreamHeaders",
           "call_batch", "call_local", "call_local_on_loop", "local_call", "open_stream", "open_stream_on_loop",
           "status_of"]
