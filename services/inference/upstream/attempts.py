"""One request's walk over its upstreams: retries, fallbacks, cooldowns, all before the first byte.

The plan is the routed model's upstream, then its `fallbacks` in order; a prompt too long
for a model switches the plan to its `context_fallback`. On each upstream of the plan:

- an ejected upstream (cooling down after `eject_after_failures` failures in a row, Envoy's
  outlier detection: `services/common/outlier.py`) is skipped without a call; after its
  cooldown one request at a time probes it, and one answer puts it back;
- a failure worth retrying (unreachable, a timeout, a 5xx, a malformed answer, a 429) is
  retried up to `retries` times, after a short jittered backoff or the 429's Retry-After
  (one longer than `max_retry_after_s` moves on to the next upstream at once), each retry
  only while the upstream's retry budget allows it (`retry_budget.py`);
- a failure that another server may not share (those, a 401/403/404, the upstream at its
  concurrency cap) moves on to the next upstream; one that is the request's own (a 400)
  ends the walk: every other server would refuse it too.

Every wait is bounded by the request's deadline, and a client that goes away ends the
walk at once. The attempts are counted, and the time spent in upstream exchanges (the
model's time, for `x-spine-overhead-duration-ms`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Generator, Mapping
from typing import Any, TypeVar

import grpc

from services.common.loop_bound import call_on_its_loop
from services.common.outlier import Ejected
from services.inference.upstream.endpoint import UpstreamEndpoint
from services.inference.upstream.failures import FALLS_BACK, RETRYABLE, UNHEALTHY, AttemptFailure, Kind
from services.inference.upstream.pieces import Pieces
from services.inference.upstream.protocols import Delta

T = TypeVar("T")

BACKOFF_S = 0.025  # the first retry's base wait (Envoy's), doubled per retry, jittered
MAX_BACKOFF_S = 0.25
GRACE_S = 1.0  # past an attempt's own timeout, the handler stops waiting for the loop
_GONE = object()  # the client went away (in a stream's queue)


class Cancelled(Exception):
    """The client went away, or its deadline passed, while upstreams were tried."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _no_verdict(endpoint: UpstreamEndpoint) -> None:
    """An attempt that said nothing of the upstream's health (cancelled, or never sent)."""
    endpoint.outlier.record(grpc.StatusCode.DEADLINE_EXCEEDED, 0.0)


class Walk:
    """The attempts of one request."""

    def __init__(self, endpoints: Mapping[str, UpstreamEndpoint], model_id: str, call: Any,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.endpoints = endpoints
        self.first = endpoints[model_id]
        self.call = call  # the request's call (`services.inference.rpcs.ModelCall`)
        self.clock = clock
        self.attempts = 0
        self.upstream_s = 0.0  # time spent in upstream exchanges
        self.served_by = self.first  # the upstream that answered, or the last one tried
        self.failures: list[AttemptFailure] = []  # every failed attempt, in order (for the operator's log)
        self._gone = threading.Event()
        self._future: concurrent.futures.Future[Any] | asyncio.Future[Any] | None = None
        self._queue: Pieces | None = None
        if not call.add_callback(self._client_went_away):
            self._gone.set()

    # -- the plan --------------------------------------------------------------------------
    def run(self, attempt: Callable[[UpstreamEndpoint, float], T]) -> T:
        """`attempt(endpoint, timeout_s)` over the plan until one returns; the last failure if none does.
        Blocking: the attempts are waited for, the backoffs slept, in the caller's thread."""
        steps = self._steps()
        sent: Any = None
        error: Exception | None = None
        while True:
            try:
                step = steps.send(sent) if error is None else steps.throw(error)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            sent, error = None, None
            try:
                if isinstance(step, _Attempt):
                    sent = attempt(step.endpoint, step.timeout_s)
                else:
                    self._sleep(step)
            except Exception as failure:  # the walk decides what each failure means
                error = failure

    async def run_on_loop(self, attempt: Callable[[UpstreamEndpoint, float], Awaitable[T]]) -> T:
        """`run`, on the caller's event loop: each attempt awaited, each backoff an
        `asyncio.sleep` that the client's leaving cuts short (the same plan, `_steps`)."""
        steps = self._steps()
        sent: Any = None
        error: Exception | None = None
        while True:
            try:
                step = steps.send(sent) if error is None else steps.throw(error)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            sent, error = None, None
            try:
                if isinstance(step, _Attempt):
                    sent = await attempt(step.endpoint, step.timeout_s)
                else:
                    await self._sleep_on_loop(step)
            except Exception as failure:
                error = failure

    def _steps(self) -> Generator[_Attempt | float, Any, Any]:
        """The walk as steps its driver carries out, so the blocking and the awaited walk are
        one plan: it yields an `_Attempt` and is sent the attempt's result (or has its failure
        thrown in), or yields a backoff in seconds to wait; it returns the answer."""
        plan = deque([self.first, *(self.endpoints[name] for name in self.first.spec.fallbacks)])
        tried: set[str] = set()
        last: AttemptFailure | None = None
        while plan:
            endpoint = plan.popleft()
            if endpoint.model_id in tried:
                continue
            tried.add(endpoint.model_id)
            tries = 0
            while True:
                timeout_s = self._timeout(endpoint)
                if endpoint.in_flight >= endpoint.spec.max_connections:  # the loop checks again, exactly
                    last = endpoint.busy()
                    break
                try:
                    endpoint.outlier.admit()
                except Ejected as ejected:
                    last = AttemptFailure(Kind.EJECTED, f"{endpoint!r}: {ejected.details()}")
                    break
                if tries == 0:
                    endpoint.budget.request()
                elif not endpoint.budget.try_retry():
                    _no_verdict(endpoint)
                    if last is not None:
                        last = dataclasses.replace(
                            last, message=last.message + "; not retried: the upstream's retry budget is spent")
                    break
                self.attempts += 1
                self.served_by = endpoint
                started = time.perf_counter()
                try:
                    result = yield _Attempt(endpoint, timeout_s)
                except AttemptFailure as failure:
                    self.upstream_s += time.perf_counter() - started
                    self._record(endpoint, failure, timeout_s)
                    self.failures.append(failure)
                    last = failure
                    context = endpoint.spec.context_fallback
                    if failure.kind == Kind.CONTEXT and context is not None and context not in tried:
                        plan = deque([self.endpoints[context]])
                        break
                    if failure.kind not in FALLS_BACK:
                        raise
                    tries += 1
                    if failure.kind not in RETRYABLE or tries > endpoint.spec.retries:
                        break
                    wait = self._backoff(endpoint, failure, tries)
                    if wait is None:
                        break
                    yield wait
                    continue
                except Cancelled:
                    _no_verdict(endpoint)
                    raise
                self.upstream_s += time.perf_counter() - started
                endpoint.outlier.record(grpc.StatusCode.OK, timeout_s)
                return result
        assert last is not None
        raise last

    def _timeout(self, endpoint: UpstreamEndpoint) -> float:
        """The attempt's time: the upstream's timeout_s, less when the request has less left."""
        if self._gone.is_set():
            raise Cancelled(grpc.StatusCode.CANCELLED, "the client went away")
        remaining = self.call.time_remaining()
        if remaining is not None and remaining <= 0:
            raise Cancelled(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"the request's deadline passed after {self.attempts} upstream attempt(s)")
        return endpoint.spec.timeout_s if remaining is None else min(endpoint.spec.timeout_s, remaining)

    @staticmethod
    def _record(endpoint: UpstreamEndpoint, failure: AttemptFailure, timeout_s: float) -> None:
        if failure.kind == Kind.TIMEOUT:
            endpoint.outlier.record(grpc.StatusCode.DEADLINE_EXCEEDED, timeout_s)
        elif failure.kind in UNHEALTHY:
            endpoint.outlier.record(grpc.StatusCode.UNAVAILABLE, timeout_s)
        elif failure.kind == Kind.BUSY:
            _no_verdict(endpoint)
        else:  # it answered (a 429, a 400): alive
            endpoint.outlier.record(grpc.StatusCode.OK, timeout_s)

    def _backoff(self, endpoint: UpstreamEndpoint, failure: AttemptFailure, tries: int) -> float | None:
        """How long to wait before retrying `endpoint`; None: not worth waiting for (move on)."""
        if failure.retry_after_s is not None:
            if failure.retry_after_s > endpoint.spec.max_retry_after_s:
                return None
            wait = failure.retry_after_s
        else:
            wait = min(MAX_BACKOFF_S, BACKOFF_S * 2 ** (tries - 1)) * random.uniform(0.5, 1.5)
        remaining = self.call.time_remaining()
        return None if remaining is not None and wait >= remaining else wait

    def _sleep(self, seconds: float) -> None:
        if self._gone.wait(seconds):
            raise Cancelled(grpc.StatusCode.CANCELLED, "the client went away")

    async def _sleep_on_loop(self, seconds: float) -> None:
        await self.wait_on_loop(asyncio.sleep(seconds), None)

    # -- waiting for the loop --------------------------------------------------------------
    def wait(self, future: concurrent.futures.Future[T], timeout_s: float) -> T:
        """A unary attempt's result, raising its AttemptFailure; bounded by the attempt's
        timeout (plus a grace for the client's own timer to fire first)."""
        self._future = future
        if self._gone.is_set():
            future.cancel()
        try:
            return future.result(timeout_s + GRACE_S)
        except concurrent.futures.CancelledError:
            raise Cancelled(grpc.StatusCode.CANCELLED, "the client went away") from None
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise AttemptFailure(Kind.TIMEOUT, f"{self.served_by!r} did not answer within {timeout_s:.3g}s") from None
        finally:
            self._future = None

    async def wait_on_loop(self, coroutine: Coroutine[Any, Any, T], timeout_s: float | None) -> T:
        """`wait`, on the caller's event loop: the attempt runs as a task of this loop, which
        the client's leaving cancels (`_client_went_away`); bounded like `wait` (None: by
        nothing, for a backoff's sleep)."""
        task = asyncio.ensure_future(coroutine)
        self._future = task
        if self._gone.is_set():
            task.cancel()
        try:
            done, _ = await asyncio.wait((task,), timeout=None if timeout_s is None else timeout_s + GRACE_S)
            if not done:
                raise AttemptFailure(Kind.TIMEOUT, f"{self.served_by!r} did not answer within {timeout_s:.3g}s")
            if task.cancelled():
                raise Cancelled(grpc.StatusCode.CANCELLED, "the client went away")
            return task.result()
        finally:
            if not task.done():  # timed out, or the caller itself was cancelled: the attempt ends too
                task.cancel()
            self._future = None

    def stream_queue(self) -> Pieces:
        """A fresh queue for the next stream attempt's pieces (the client's leaving is put on it too)."""
        self._queue = Pieces()
        if self._gone.is_set():
            self._queue.end(_GONE)
        return self._queue

    def next_piece(self, pieces: Pieces, timeout_s: float) -> Delta | None:
        """The stream's next Delta, None at its end; raises its AttemptFailure, or Cancelled."""
        try:
            item = pieces.get(timeout_s + GRACE_S)
        except queue.Empty:
            raise AttemptFailure(Kind.TIMEOUT, f"{self.served_by!r} sent nothing for {timeout_s:.3g}s") from None
        return self._piece(item)

    async def next_piece_on_loop(self, pieces: Pieces, timeout_s: float) -> Delta | None:
        """`next_piece`, awaited on the event loop the stream is read on."""
        try:
            item = await pieces.get_on_loop(timeout_s + GRACE_S)
        except queue.Empty:
            raise AttemptFailure(Kind.TIMEOUT, f"{self.served_by!r} sent nothing for {timeout_s:.3g}s") from None
        return self._piece(item)

    def _piece(self, item: Any) -> Delta | None:
        if item is _GONE:
            raise Cancelled(grpc.StatusCode.CANCELLED, "the client went away")
        if isinstance(item, AttemptFailure):
            raise item
        return item  # type: ignore[no-any-return]

    def watch(self, future: concurrent.futures.Future[Any] | asyncio.Future[Any]) -> None:
        """The running stream attempt: cancelled when the client goes away."""
        self._future = future
        if self._gone.is_set():
            future.cancel()

    def _client_went_away(self) -> None:
        self._gone.set()
        future = self._future
        if isinstance(future, asyncio.Future):  # an attempt on an event loop: cancelled on that loop
            call_on_its_loop(future.get_loop(), future.cancel)
        elif future is not None:
            future.cancel()
        if self._queue is not None:
            self._queue.end(_GONE)


@dataclasses.dataclass(frozen=True, slots=True)
class _Attempt:
    """One step of a walk: an attempt at `endpoint` within `timeout_s`."""

    endpoint: UpstreamEndpoint
    timeout_s: float
