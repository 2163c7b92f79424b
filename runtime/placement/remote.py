"""A component in another process: one proxy for every interface, over gRPC.

`remote(interface, stub, ...)` implements any component's interface (`services/<name>/api.py`)
from its table of operations: each call is encoded with its operation's codec, sent as the
rpc it names, and its answer decoded (`services.pipeline.batch_rpc`, `services.pipeline.interface`)
— Service Weaver's remote stub, made from the codecs at run time instead of generated.

Calls that the component will not answer end fast: with an `OutlierDetector` (`guarded`,
which wraps any implementation the same way, a foreign client's too) a component that keeps
failing is ejected, and when the gateway's health watcher finds it stopped answering
(`RemoteComponent.abandon`) the calls already waiting on it are cancelled and end
UNAVAILABLE (they would otherwise each wait out their whole deadline on a process that is
not going to answer). An error naming the upstream server that failed (`x-spine-upstream`)
is the component's answer, not its failure: a flaky upstream never ejects the inference
process that reports it.

A call made on an event loop (the HTTP API's, through `services.pipeline.loop_bridge`) goes
out on a grpc.aio stub of the same component and is awaited there, so a request served on
the loop never waits on a thread; the budget, the outlier detector, the caller's cancel and
`abandon` act on it as on a call from a thread (`LoopLink`, `_unary_on_loop`).
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import grpc

from runtime.config.sections import TlsConfig
from runtime.tls import link_channel, link_credentials
from services.common.outlier import Ejected, OutlierDetector
from services.pipeline.batch_rpc import BatchRpc
from services.pipeline.interface import NO_OPTIONS, CallOptions, Interface, Method, UnaryRpc
from services.pipeline.local_call import status_of
from services.pipeline.local_context import LocalRpcError
from services.pipeline.loop_bridge import on_loop_now, wait_for
from services.pipeline.verdicts import UPSTREAM_HEADER

T = TypeVar("T")


@dataclass(frozen=True)
class LoopLink:
    """How to open the component's channel on an event loop: a grpc.aio channel (and its stub)
    is bound to the loop that made it, so each loop that calls gets its own, from these."""

    address: str
    credentials: grpc.ChannelCredentials | None
    options: tuple[tuple[str, Any], ...]
    stub_class: Callable[[Any], Any]

    def open(self) -> Any:
        """A grpc.aio channel to the component (on the running loop)."""
        if self.credentials is None:
            return grpc.aio.insecure_channel(self.address, options=list(self.options))
        return grpc.aio.secure_channel(self.address, self.credentials, options=list(self.options))


class LoopCall:
    """A grpc.aio call in flight, cancellable from any thread (the health watcher's `abandon`,
    a client's hang-up): an aio call belongs to its loop, so another thread asks the loop."""

    __slots__ = ("call", "loop", "cancelled")

    def __init__(self, call: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.call = call
        self.loop = loop
        self.cancelled = False  # cancelled by us (the caller, or `abandon`), not by the task's own cancel

    def cancel(self) -> None:
        """Cancel the call: at once on its loop's thread, else asked of the loop."""
        self.cancelled = True
        try:
            here = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            here = False
        if here:
            self.call.cancel()
        elif not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.call.cancel)


class RemoteComponent:
    """Base of the remote proxies: the stub its calls go through, the calls in flight."""

    placement = "remote"

    def __init__(self, component: str, stub: object, channel: grpc.Channel,
                 detector: OutlierDetector | None = None, loop_link: LoopLink | None = None) -> None:
        self.component = component
        self.stub = stub
        self.channel = channel
        self.detector = detector
        self.loop_link = loop_link
        self._on_loops: dict[asyncio.AbstractEventLoop, tuple[Any, Any]] = {}  # loop: (aio channel, stub)
        self._inflight: set[Any] = set()
        self._abandoned: dict[int, str] = {}
        self._lock = threading.Lock()

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

    @property
    def awaits_on_loop(self) -> bool:
        """Whether a caller on an event loop may await this component there (`loop_bridge`)."""
        return self.loop_link is not None

    def close(self) -> None:
        self.channel.close()
        with self._lock:
            on_loops, self._on_loops = self._on_loops, {}
        for loop, (channel, _) in on_loops.items():
            if not loop.is_closed():  # an aio channel is closed on its own loop
                asyncio.run_coroutine_threadsafe(channel.close(), loop)

    # -- one call ---------------------------------------------------------------------------
    def _unary(self, rpc: str, request: Any, options: CallOptions) -> tuple[Any, Sequence[tuple[str, str]]]:
        """(the answer, its trailing metadata) of the unary rpc `rpc`, or its `grpc.RpcError`;
        awaited on the loop when called there (`loop_bridge`), waited for on this thread else."""
        if self.loop_link is not None and on_loop_now():
            return wait_for(self._unary_on_loop(rpc, request, options))
        self._admit()
        future = getattr(self.stub, rpc).future(request, timeout=options.timeout,
                                                metadata=tuple(options.metadata) or None)
        self._track(future)
        if options.parent is not None:
            options.parent.add_callback(future.cancel)
        code, failure = grpc.StatusCode.OK, None
        try:
            return future.result(), tuple(future.trailing_metadata() or ())
        except grpc.RpcError as error:
            code, failure = status_of(error), error
            raise
        except grpc.FutureCancelledError as error:
            code, verdict = self._cancelled(future)
            raise verdict from error
        finally:
            self._untrack(future)
            self._record(code, options.timeout, failure)

    async def _unary_on_loop(self, rpc: str, request: Any,
                             options: CallOptions) -> tuple[Any, Sequence[tuple[str, str]]]:
        """`_unary` on the running loop's grpc.aio stub: the same budget, outlier record,
        cancel and abandon; the answer's trailers come with it."""
        self._admit()
        loop = asyncio.get_running_loop()
        call = getattr(self._loop_stub(loop), rpc)(request, timeout=options.timeout,
                                                   metadata=tuple(options.metadata) or None)
        handle = LoopCall(call, loop)
        self._track(handle)
        if options.parent is not None:
            options.parent.add_callback(handle.cancel)
        code, failure = grpc.StatusCode.OK, None
        try:
            answer = await call
            return answer, tuple(await call.trailing_metadata() or ())
        except grpc.RpcError as error:
            code, failure = status_of(error), error
            raise
        except asyncio.CancelledError as error:
            if not handle.cancelled:  # the task itself was cancelled: not this call's verdict
                code = grpc.StatusCode.CANCELLED
                raise
            code, verdict = self._cancelled(handle)
            raise verdict from error
        finally:
            self._untrack(handle)
            self._record(code, options.timeout, failure)

    def _loop_stub(self, loop: asyncio.AbstractEventLoop) -> Any:
        """This loop's stub of the component, its channel opened on first use."""
        made = self._on_loops.get(loop)
        if made is None:
            assert self.loop_link is not None
            channel = self.loop_link.open()
            made = (channel, self.loop_link.stub_class(channel))
            with self._lock:
                self._on_loops[loop] = made
        return made[1]

    def _stream(self, rpc: str, request: Any, options: CallOptions) -> RemoteStream:
        self._admit()
        call = getattr(self.stub, rpc)(request, timeout=options.timeout, metadata=tuple(options.metadata) or None)
        if options.parent is not None:
            options.parent.add_callback(call.cancel)
        self._track(call)

        def ended(code: grpc.StatusCode, error: BaseException | None) -> str | None:
            self._record(code, options.timeout, error)
            return self._untrack(call)

        return RemoteStream(call, ended, self._gone)

    def _admit(self) -> None:
        if self.detector is not None:
            self.detector.admit()  # Ejected: failing fast, no call is made

    def _record(self, code: grpc.StatusCode, timeout: float | None, error: BaseException | None) -> None:
        if self.detector is not None:
            self.detector.record(grpc.StatusCode.OK if upstreams_fault(error) else code, timeout)

    def _track(self, call: Any) -> None:
        with self._lock:
            self._inflight.add(call)

    def _untrack(self, call: Any) -> str | None:
        """Forget a finished call; why it was abandoned, if it was."""
        with self._lock:
            self._inflight.discard(call)
            return self._abandoned.pop(id(call), None)

    def _cancelled(self, call: Any) -> tuple[grpc.StatusCode, grpc.RpcError]:
        """What a call cancelled on this side ends as: UNAVAILABLE where `abandon` cancelled it
        (the component stopped answering), else CANCELLED (its caller went away)."""
        reason = self._untrack(call)
        if reason is not None:
            return grpc.StatusCode.UNAVAILABLE, self._gone(reason)
        return grpc.StatusCode.CANCELLED, LocalRpcError(grpc.StatusCode.CANCELLED, "Cancelled by the caller")

    def _gone(self, reason: str) -> Ejected:
        return Ejected(f"{self.component} stopped answering ({reason}); the call was cancelled")


def remote(interface: Interface[T], stub: object, channel: grpc.Channel,
           detector: OutlierDetector | None = None, loop_link: LoopLink | None = None,
           base: type[RemoteComponent] = RemoteComponent) -> T:
    """The component of `interface` behind `stub` (its generated stub on `channel`); with
    `loop_link`, awaited on an event loop when called there. `base` adds what the interface's
    table cannot say (the model's answer awaited on a loop: `runtime.placement.remote_model`)."""
    made = _remote_class(interface, base)  # type: ignore[arg-type]  # a class is hashable
    return cast(T, made(interface.component, stub, channel, detector, loop_link))


@functools.cache
def _remote_class(interface: Interface[Any], base: type[RemoteComponent]) -> type[RemoteComponent]:
    operations = {name: _operation(method) for name, method in interface.methods.items()}
    return type(f"Remote_{interface.component}", (base,), operations)


def _operation(method: Method) -> Callable[..., Any]:
    if isinstance(method, BatchRpc):
        batch = method

        def call_batch(self: RemoteComponent, items: Any, options: CallOptions = NO_OPTIONS) -> Any:
            answer, _ = self._unary(batch.rpc, batch.encode_items(items), options)
            return batch.decode_results(answer)
        return call_batch
    if isinstance(method, UnaryRpc):
        unary = method

        def call_unary(self: RemoteComponent, argument: Any, options: CallOptions = NO_OPTIONS) -> Any:
            answer, trailing = self._unary(unary.rpc, unary.encode(argument), options)
            return unary.decode(answer, trailing)
        return call_unary
    stream = method

    def call_stream(self: RemoteComponent, request: Any, options: CallOptions = NO_OPTIONS) -> Any:
        return self._stream(stream.rpc, request, options)
    return call_stream


class RemoteStream:
    """A server-streaming call that reports its final status once; a stream abandoned because
    the component stopped answering ends UNAVAILABLE, not CANCELLED."""

    def __init__(self, call: Any, on_end: Callable[[grpc.StatusCode, BaseException | None], str | None],
                 gone: Callable[[str], grpc.RpcError]) -> None:
        self._call = call
        self._on_end = on_end
        self._gone = gone
        self._ended = False

    def __iter__(self) -> Iterator[Any]:
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

    def initial_metadata(self) -> Sequence[tuple[str, str]]:
        """What the servicer sent before its first message (available once one has arrived)."""
        return tuple(self._call.initial_metadata() or ())

    def trailing_metadata(self) -> Sequence[tuple[str, str]]:
        return tuple(self._call.trailing_metadata() or ())

    def _end(self, code: grpc.StatusCode, error: BaseException | None = None) -> str | None:
        if self._ended:
            return None
        self._ended = True
        return self._on_end(code, error)


class Guarded:
    """Base of `guarded`'s wrappers: an implementation, and its component's outlier detector."""

    placement = "remote"

    def __init__(self, implementation: object, detector: OutlierDetector) -> None:
        self.implementation = implementation
        self.detector = detector


def guarded(interface: Interface[T], implementation: T, detector: OutlierDetector) -> T:
    """`implementation` (a foreign service's client) with outlier ejection: a component that
    keeps failing fails fast, as a remote one does."""
    return cast(T, _guarded_class(interface)(implementation, detector))


@functools.cache
def _guarded_class(interface: Interface[Any]) -> type[Guarded]:
    operations = {name: _guarded_operation(name) for name in interface.methods}
    return type(f"Guarded_{interface.component}", (Guarded,), operations)


def _guarded_operation(name: str) -> Callable[..., Any]:
    def operation(self: Guarded, argument: Any, options: CallOptions = NO_OPTIONS) -> Any:
        self.detector.admit()
        code, failure = grpc.StatusCode.OK, None
        try:
            return getattr(self.implementation, name)(argument, options)
        except grpc.RpcError as error:
            code, failure = status_of(error), error
            raise
        finally:
            self.detector.record(grpc.StatusCode.OK if upstreams_fault(failure) else code, options.timeout)

    operation.__name__ = name
    return operation


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
    return link_channel(address, tls, options=_link_options(max_message_bytes))


def loop_link(address: str, max_message_bytes: int, stub_class: Callable[[Any], Any],
              tls: TlsConfig | None = None) -> LoopLink:
    """`remote_channel`'s twin for callers on an event loop: the same address, credentials and
    options, opened as a grpc.aio channel by each loop that calls."""
    return LoopLink(address, link_credentials(tls, address), tuple(_link_options(max_message_bytes)), stub_class)


def _link_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.enable_retries", 0),
        # A restarted child is back within a second; the default backoff (1 s, growing to
        # 120 s) would keep the link down long after the supervisor has brought it back.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]
