"""The spine's batched stages: admission and completion decided per micro-batch.

`BatchedAdmission` replaces the gateway's per-request calls from auth to the cache probe:
one `verify_many`, validation, the router, ONE `admit_asks` (exactly the sequential
result in arrival order) and ONE `lookup_keys` per batch. `BatchedCompletions` replaces
the per-request metrics, log and cache-store calls: a finished request hands them over
and answers at once; they are written a window at a time (ONE `record_batch` and ONE
`append_batch` per window), always before anyone reads them. Admission hands its
verdicts to the same functions the per-request gateway uses (`services.pipeline.verdicts`),
so codes, messages and trailers do not depend on the batching; a request that fails a
stage fails alone.

Binding hooks (fault injection, spans) still run around each request's part of a stage,
with the component and method names the bindings would use.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from monolith.batcher import BatcherClosed, BatchStats, MicroBatcher
from services.auth import AuthDenied, AuthService
from services.cache import CacheService, InvalidCacheRequest
from services.common import ConfigError, number
from services.logs import LogsService
from services.metrics import MetricsService
from services.pipeline.gateway import Admitted, RequestState
from services.pipeline.verdicts import (
    MISSING_CREDENTIAL,
    RequestLimits,
    Stop,
    admission_stop,
    bearer,
    downstream_stop,
    rate_limit_ask,
    rate_limit_cost,
    rate_limit_stop,
    resolved_request,
)
from services.ratelimit import InvalidRateLimitRequest, RateLimitService
from services.router import RouterService
from spine.runtime.tracing import current_traceparent
from spine.v1 import generation_pb2, logs_pb2, metrics_pb2

log = logging.getLogger("spine.pipeline")

_FIELDS = ("enabled", "max_batch", "max_wait_us", "completion_interval_ms")
FailOpen = Callable[[str, str, str], None]  # (middleware, reason, request id)


@dataclass(frozen=True)
class BatchingConfig:
    """The `batching` section: whether the collapsed pipeline batches, and its window."""

    enabled: bool = True
    max_batch: int = 32
    max_wait_us: float = 500.0
    # How often finished requests' metrics and log lines are written, a window at a time,
    # off the request path (see BatchedCompletions); readers and shutdown never wait for it.
    completion_interval_ms: float = 50.0

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> BatchingConfig:
        cfg = config.get("batching") or {}
        if not isinstance(cfg, Mapping):
            raise ConfigError(f"batching: expected a mapping, got {type(cfg).__name__}")
        unknown = sorted(set(cfg) - set(_FIELDS))
        if unknown:
            raise ConfigError(f"batching.{unknown[0]}: unknown key (known: {', '.join(_FIELDS)})")
        enabled = cfg.get("enabled", cls.enabled)
        if not isinstance(enabled, bool):
            raise ConfigError(f"batching.enabled: expected true or false, got {enabled!r}")
        max_batch = cfg.get("max_batch", cls.max_batch)
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or not 1 <= max_batch <= 4096:
            raise ConfigError(f"batching.max_batch: expected an integer from 1 to 4096, got {max_batch!r}")
        wait = number(cfg, "max_wait_us", cls.max_wait_us, where="batching", minimum=0, maximum=100_000)
        interval = number(cfg, "completion_interval_ms", cls.completion_interval_ms, where="batching",
                          minimum=1, maximum=10_000)
        return cls(enabled=enabled, max_batch=max_batch, max_wait_us=wait, completion_interval_ms=interval)


@dataclass(eq=False)
class _Ticket:
    request: generation_pb2.GenerateRequest
    state: RequestState
    outcome: Admitted | Stop | None = None
    credential: str = ""
    principal: Any = None
    resolved: generation_pb2.GenerateRequest | None = None
    # The request's trace context, taken in its own thread: a batch stage runs on whichever
    # thread decides the batch, and its spans must still hang under this request's root.
    trace: tuple[tuple[str, str], ...] = ()

    @property
    def open(self) -> bool:
        return self.outcome is None


def _ignore(name: str, reason: str, request_id: str) -> None:
    """A fail-open failure nobody asked to count."""


def _unexpected(name: str, error: BaseException) -> Stop:
    """What a bug in a fail-closed service looks like through a binding: UNAVAILABLE."""
    return downstream_stop(name, grpc.StatusCode.UNKNOWN, f"Exception calling application: {error}")


class _Stage:
    """Times one stage of a batch and runs the binding hooks around each request's part."""

    def __init__(self, name: str, method: str, hooks: Sequence[Any], tickets: list[_Ticket],
                 fail_open: FailOpen | None = None) -> None:
        self.name = name
        self.method = method
        self.hooks = hooks
        self.fail_open = fail_open  # set for a fail-open stage: a hook failure skips the stage instead
        self.tickets: list[_Ticket] = []
        self._tokens: list[list[Any]] = []
        now = time.monotonic()
        for ticket in tickets:
            if not ticket.open:
                continue
            if now >= ticket.state.deadline and fail_open is None:
                ticket.outcome = Stop(grpc.StatusCode.DEADLINE_EXCEEDED, f"deadline exceeded while waiting for {name}")
                continue
            tokens = self._begin(ticket)
            if tokens is not None:
                self.tickets.append(ticket)
                self._tokens.append(tokens)
        self.started = time.perf_counter()

    def _begin(self, ticket: _Ticket) -> list[Any] | None:
        """The hooks' tokens; None when a hook failed the call (the ticket then has its outcome)."""
        tokens: list[Any] = []
        if not self.hooks:
            return tokens
        metadata = [("x-request-id", ticket.state.request_id), *ticket.trace]
        for hook in self.hooks:
            try:
                tokens.append(hook.begin(self.name, self.method, metadata))
            except grpc.RpcError as error:
                code, details = _code_details(error)
                self._end_hooks(tokens, code)
                if self.fail_open is not None:
                    ticket.state.failures.append(self.name)
                    self.fail_open(self.name, code.name, ticket.state.request_id)
                else:
                    ticket.outcome = downstream_stop(self.name, code, details)
                return None
        return tokens

    def _end_hooks(self, tokens: list[Any], code: grpc.StatusCode) -> None:
        for hook, token in zip(reversed(self.hooks[:len(tokens)]), reversed(tokens), strict=True):
            hook.end(token, code)

    def finish(self) -> None:
        spent = time.perf_counter() - self.started
        for ticket, tokens in zip(self.tickets, self._tokens, strict=True):
            state = ticket.state
            state.middleware_s[self.name] = state.middleware_s.get(self.name, 0.0) + spent
            if self.hooks:
                code = ticket.outcome.code if isinstance(ticket.outcome, Stop) else grpc.StatusCode.OK
                self._end_hooks(tokens, code)


def _code_details(error: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    call: Any = error
    code = call.code() if callable(getattr(call, "code", None)) else grpc.StatusCode.UNKNOWN
    details = str(call.details() if callable(getattr(call, "details", None)) else error)
    return code, details


class BatchedAdmission:
    """Auth → validation → router → ratelimit → cache probe for a micro-batch at a time."""

    def __init__(self, auth: AuthService, router: RouterService, ratelimit: RateLimitService, cache: CacheService,
                 limits: RequestLimits, config: BatchingConfig, *, expected: Callable[[], int] | None = None,
                 fail_open: FailOpen | None = None, hooks: Sequence[Any] = ()) -> None:
        self.auth, self.router, self.ratelimit, self.cache = auth, router, ratelimit, cache
        self.limits = limits
        self.hooks = list(hooks)
        self._fail_open = fail_open
        self.batcher: MicroBatcher[_Ticket, Admitted] = MicroBatcher(
            self.decide, max_batch=config.max_batch, max_wait_s=config.max_wait_us / 1e6, expected=expected)

    def admit(self, request: generation_pb2.GenerateRequest, state: RequestState) -> Admitted:
        """The gateway's `Admission`: wait for this request's batch; its verdict or `Stop`."""
        try:
            return self.batcher.submit(_Ticket(request, state, trace=current_traceparent() if self.hooks else ()))
        except BatcherClosed:
            raise Stop(grpc.StatusCode.UNAVAILABLE, "the spine is shutting down; retry on another replica") from None

    def close(self) -> None:
        self.batcher.close()

    # -- one batch --------------------------------------------------------------------------
    def decide(self, tickets: list[_Ticket]) -> list[Admitted | Stop]:
        """Every ticket's verdict, in the gateway's order; the others go on when one fails."""
        self._authenticate(tickets)
        self._route(tickets)
        self._rate_limit(tickets)
        self._probe_cache(tickets)
        out: list[Admitted | Stop] = []
        for ticket in tickets:
            assert ticket.outcome is not None
            out.append(ticket.outcome)
        return out

    def _authenticate(self, tickets: list[_Ticket]) -> None:
        for ticket in tickets:
            ticket.state.model = ticket.request.model
            credential = bearer(ticket.state.metadata)
            if credential is None:
                ticket.outcome = Stop(grpc.StatusCode.UNAUTHENTICATED, MISSING_CREDENTIAL)
            else:
                ticket.credential = credential
        stage = _Stage("auth", "Check", self.hooks, tickets)
        try:
            asking = stage.tickets
            try:
                verdicts = self.auth.verify_many([t.credential for t in asking])
            except Exception as error:
                for ticket in asking:
                    ticket.outcome = _unexpected("auth", error)
                return
            for ticket, verdict in zip(asking, verdicts, strict=True):
                if isinstance(verdict, AuthDenied):
                    ticket.outcome = downstream_stop("auth", verdict.code, verdict.message)
                else:
                    ticket.principal = verdict.principal
        finally:
            stage.finish()
        for ticket in tickets:
            if ticket.open:
                ticket.state.tenant = ticket.principal.tenant
                ticket.outcome = admission_stop(ticket.request, ticket.principal, self.limits)

    def _route(self, tickets: list[_Ticket]) -> None:
        stage = _Stage("router", "Resolve", self.hooks, tickets)
        try:
            for ticket in stage.tickets:
                try:
                    route = self.router.resolve(ticket.request.model)
                except LookupError as error:
                    ticket.outcome = downstream_stop("router", grpc.StatusCode.NOT_FOUND, str(error))
                    continue
                except Exception as error:
                    ticket.outcome = _unexpected("router", error)
                    continue
                ticket.state.model = route.model_id
                ticket.resolved = resolved_request(ticket.request, route.model_id)
        finally:
            stage.finish()

    def _rate_limit(self, tickets: list[_Ticket]) -> None:
        stage = _Stage("ratelimit", "ShouldRateLimit", self.hooks, tickets)
        try:
            asking: list[tuple[_Ticket, Any]] = []
            for ticket in stage.tickets:
                assert ticket.resolved is not None
                asking.append((ticket, rate_limit_ask(ticket.state.tenant, ticket.resolved, ticket.state.shadow)))
            for ticket, reply in self._admit_valid(asking):
                if isinstance(reply, Stop):
                    ticket.outcome = reply
                    continue
                assert ticket.resolved is not None
                ticket.outcome = rate_limit_stop(reply, rate_limit_cost(ticket.resolved))
        finally:
            stage.finish()

    def _admit_valid(self, asking: list[tuple[_Ticket, Any]]) -> list[tuple[_Ticket, Any]]:
        """Each ticket with its reply. A malformed request fails alone, INVALID_ARGUMENT: the
        batch names it (`InvalidRateLimitRequest.index`, raised before any bucket changes)
        and is decided again without it — a batch is parsed once when all are well formed."""
        while True:
            try:
                return list(zip([t for t, _ in asking], self._admit([m for _, m in asking]), strict=True))
            except InvalidRateLimitRequest as error:
                ticket, _ = asking.pop(error.index)
                ticket.outcome = downstream_stop("ratelimit", grpc.StatusCode.INVALID_ARGUMENT, str(error))

    def _admit(self, messages: list[Any]) -> list[Any]:
        """ONE admit_asks; on a full bucket table, one by one (so only the one that needs room fails)."""
        if not messages:
            return []
        try:
            return list(self.ratelimit.admit_asks(messages))
        except MemoryError:
            pass
        except InvalidRateLimitRequest:
            raise  # `_admit_valid` takes the malformed one out
        except Exception as error:
            return [_unexpected("ratelimit", error)] * len(messages)
        replies: list[Any] = []
        for message in messages:
            try:
                replies.append(self.ratelimit.admit_asks([message])[0])
            except MemoryError as error:
                replies.append(downstream_stop("ratelimit", grpc.StatusCode.RESOURCE_EXHAUSTED,
                                               f"ratelimit: no room for a new bucket: {error}"))
            except Exception as error:
                replies.append(_unexpected("ratelimit", error))
        return replies

    def _probe_cache(self, tickets: list[_Ticket]) -> None:
        """ONE lookup_keys; the cache fails open, so a failure is a counted miss. Each request
        is keyed once here, and its store reuses the key (`RequestState.cache_key`)."""
        stage = _Stage("cache", "Lookup", self.hooks, tickets, fail_open=self._fail_open or _ignore)
        try:
            probing: list[_Ticket] = []
            keys: list[bytes | None] = []
            for ticket in stage.tickets:
                assert ticket.resolved is not None
                try:
                    key = self.cache.key_for(ticket.state.tenant, ticket.resolved)
                except Exception as error:
                    self._cache_failed(ticket, "INVALID_ARGUMENT" if isinstance(error, InvalidCacheRequest)
                                       else "UNKNOWN")
                    continue
                ticket.state.cache_key = key
                probing.append(ticket)
                keys.append(key)
            answers: list[Any] = []
            if keys:
                try:
                    answers = list(self.cache.lookup_keys(keys))
                except Exception:  # all or nothing: find out which one cannot be probed
                    answers = [self._lookup_one(key) for key in keys]
            for ticket, answer in zip(probing, answers, strict=True):
                if isinstance(answer, str):
                    self._cache_failed(ticket, answer)
                elif answer is not None:
                    ticket.state.cached = True
                    ticket.state.completion_tokens = answer.completion_tokens
                    ticket.outcome = (ticket.resolved, answer)  # type: ignore[assignment]
        finally:
            stage.finish()
        for ticket in tickets:
            if ticket.open:  # a miss, or the cache failed (fail open)
                ticket.outcome = (ticket.resolved, None)  # type: ignore[assignment]

    def _lookup_one(self, key: bytes | None) -> Any:
        try:
            return self.cache.lookup_keys([key])[0]
        except Exception:
            return "UNKNOWN"

    def _cache_failed(self, ticket: _Ticket, reason: str) -> None:
        ticket.state.failures.append("cache")
        if self._fail_open is not None:
            self._fail_open("cache", reason, ticket.state.request_id)


_Completion = tuple[RequestState, metrics_pb2.RequestRecord, logs_pb2.LogRecord]


class BatchedCompletions:
    """Metrics and log lines of finished requests, written a window at a time off the request path.

    A finishing request hands its record and line over (a deque append) and its answer
    goes out at once: on a CPU host, writing them in the request's own thread cost more
    than the rest of the middleware together (the first write after a model step runs on
    caches the step has evicted). A folder thread writes what was handed over every
    `interval_s`, or as soon as `max_batch` wait: ONE record_batch and ONE append_batch
    per window.

    Nothing handed over is unseen or lost: the metrics and logs services call `drain`
    before every read (a scrape, a flush), and `close` (shutdown, or metrics and logs
    moving out of the spine) drains what is left before those services flush — so a
    SIGTERM loses no answered request's count or line.
    """

    def __init__(self, metrics: MetricsService, logs: LogsService, *, cache: CacheService | None = None,
                 max_batch: int = 256, interval_s: float = 0.05, busy: Callable[[], bool] | None = None,
                 fail_open: FailOpen | None = None, hooks: Sequence[Any] = ()) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch: must be >= 1, got {max_batch}")
        self.metrics = metrics
        self.logs = logs
        self.cache = cache
        # When nothing else is in flight the folder writes at once, in the gap before the
        # next request (a lone client never finds work waiting); under load it waits for
        # `interval_s` so a window holds many requests.
        self._busy = busy or (lambda: True)
        self._stores: deque[tuple[RequestState, bytes, generation_pb2.GenerateResponse]] = deque()
        self._store_lock = threading.Lock()
        self.max_batch = max_batch
        self.interval_s = interval_s
        self._fail_open = fail_open
        self.hooks = list(hooks)
        self.stats = BatchStats()
        self._pending: deque[_Completion] = deque()
        # Past this many waiting, a finishing request writes them itself: memory stays
        # bounded and a stalled writer slows the callers down again instead of piling up.
        self._backlog_limit = 8 * max_batch
        self._drain_lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        metrics.read_hooks.add(self.drain)
        logs.read_hooks.add(self.drain)
        if cache is not None:
            cache.read_hooks.add(self.drain_stores)
        self._thread = threading.Thread(target=self._fold, name="spine-completions", daemon=True)
        self._thread.start()

    def complete(self, state: RequestState, record: metrics_pb2.RequestRecord, line: logs_pb2.LogRecord) -> None:
        # The hooks (spans: metrics.record, logs.append) run in the request's own thread, so
        # they sit under its root exactly as the per-request gateway's do.
        tokens = self._begin_hooks(state)
        try:
            self._pending.append((state, record, line))
            if self._closed:  # a straggler after shutdown began: written now, counted if it fails
                self.drain()
            elif len(self._pending) >= self._backlog_limit:
                self.drain()  # the writes fall behind (a stalled log file?): wait for them, as before
            elif len(self._pending) >= self.max_batch or not self._busy():
                self._wake.set()
        finally:
            for hook, token in reversed(tokens):
                hook.end(token, grpc.StatusCode.OK)

    def store(self, state: RequestState, request: generation_pb2.GenerateRequest,
              response: generation_pb2.GenerateResponse) -> bool:
        """Hand a response over for the cache; False when this spine has no local cache (the
        caller then stores it itself). It is stored before any later lookup (the cache calls
        `drain_stores` first), so a repeated request still hits.

        `request` is the resolved request that was probed: when the batched probe keyed
        it, the key on `state` is used as is (a key is a pure function of tenant and
        resolved request, and both are fixed once admitted). Otherwise it is keyed here."""
        if self.cache is None:
            return False
        tokens: list[tuple[Any, Any]] = []
        for hook in self.hooks:
            try:
                tokens.append((hook, hook.begin("cache", "Store", [("x-request-id", state.request_id)])))
            except grpc.RpcError as error:  # an injected fault: the cache fails open, counted
                for begun, token in reversed(tokens):
                    begun.end(token, _code_details(error)[0])
                state.failures.append("cache")
                if self._fail_open is not None:
                    self._fail_open("cache", _code_details(error)[0].name, state.request_id)
                return True
        try:
            key = state.cache_key  # keyed at lookup; a request admitted per request is keyed now
            if key is None:
                key = self.cache.key_for(state.tenant, request)
            if key is not None:  # not cacheable (sampled without a seed): nothing to store
                self._stores.append((state, key, response))
            if self._closed:
                self.drain_stores()
        except InvalidCacheRequest as error:  # what the Store call would have refused: counted
            self._count_store_failure(state, error)
        finally:
            for hook, token in reversed(tokens):
                hook.end(token, grpc.StatusCode.OK)
        return True

    def drain_stores(self, keys: Collection[bytes] | None = None) -> None:
        """Put handed-over responses in the cache (each alone: a bad one fails alone): those
        under `keys` (what a lookup is about to probe), or all of them.

        A lookup stores only what it could find, so the stores stay off the request path:
        the folder writes the rest. The others keep their order, ahead of later arrivals,
        so the last answer handed over for a key is the one kept."""
        if self.cache is None:
            return
        with self._store_lock:  # also when the deque is empty: another thread may be storing them
            taken = [self._stores.popleft() for _ in range(len(self._stores))]
            if keys is not None:
                wanted = set(keys)
                self._stores.extendleft(reversed([item for item in taken if item[1] not in wanted]))
                taken = [item for item in taken if item[1] in wanted]
            for state, key, response in taken:
                try:
                    self.cache.store_key(key, response)
                except Exception as error:  # counted as the gateway counts a failed Store
                    self._count_store_failure(state, error)

    def _count_store_failure(self, state: RequestState, error: BaseException) -> None:
        try:
            self.metrics.record_middleware_failure("cache")
        except Exception:
            pass  # metrics fail open too
        if self._fail_open is not None:
            self._fail_open("cache", _reason(error), state.request_id)

    def drain(self) -> None:
        """Write everything handed over so far (windows of at most `max_batch`); returns once
        it is in the cache, the metrics tables and the log ring, also when another thread
        was writing."""
        self.drain_stores()
        with self._drain_lock:
            left = len(self._pending)  # what was handed over before this call; later ones can wait
            while left > 0:
                window = [self._pending.popleft() for _ in range(min(self.max_batch, left))]
                left -= len(window)
                self.stats.batches += 1
                self.stats.items += len(window)
                self.stats.largest = max(self.stats.largest, len(window))
                self.flush_window(window)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def _fold(self) -> None:
        while not self._closed:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            try:
                self.drain()
            except Exception:  # never let the folder die: readers and close still drain
                log.exception("writing finished requests' metrics and logs failed; retrying")

    def _begin_hooks(self, state: RequestState) -> list[tuple[Any, Any]]:
        begun: list[tuple[Any, Any]] = []
        for component, method in (("metrics", "Record"), ("logs", "Append")):
            for hook in self.hooks:
                try:
                    begun.append((hook, hook.begin(component, method, [("x-request-id", state.request_id)])))
                except grpc.RpcError:
                    pass  # a fault hook on a fail-open stage: the write still happens
        return begun

    def close(self) -> None:
        """Stop the folder and write what is left; later stragglers are written at once."""
        self._closed = True
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        self.drain()
        self.metrics.read_hooks.remove(self.drain)
        self.logs.read_hooks.remove(self.drain)
        if self.cache is not None:
            self.cache.read_hooks.remove(self.drain_stores)

    def flush_window(self, window: list[_Completion]) -> None:
        """ONE metrics write and ONE log write for the window (a bad item fails alone)."""
        self._write("metrics", self.metrics.record_batch, [(s, r) for s, r, _ in window])
        self._write("logs", self.logs.append_batch, [(s, line) for s, _, line in window])

    def _write(self, name: str, write: Callable[[list[Any]], None], items: list[tuple[RequestState, Any]]) -> None:
        try:
            write([item for _, item in items])
            return
        except Exception:
            pass
        for state, item in items:  # all-or-nothing failed: keep every good one, count the bad
            try:
                write([item])
            except Exception as error:
                if self._fail_open is not None:
                    self._fail_open(name, _reason(error), state.request_id)


def _reason(error: BaseException) -> str:
    if isinstance(error, MemoryError):
        return "RESOURCE_EXHAUSTED"
    if isinstance(error, ValueError):
        return "INVALID_ARGUMENT"
    return "UNAVAILABLE"
