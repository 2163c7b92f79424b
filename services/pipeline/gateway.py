"""The Gateway: the public API, and the one place where the pipeline's order lives.

The gateway calls each middleware through a client with the stub's call shape. Whether
that client is a gRPC stub to another process or a direct call into the same process is
decided by the runtime (the bindings), never here — so both layouts run this exact code
and decide identically.

Order: auth → validate → router → ratelimit → cache → inference → cache store, and
metrics + logs for every request, whatever its outcome. Auth, router, ratelimit and
inference fail closed (UNAVAILABLE when they cannot answer); cache, metrics and logs fail
open (the request goes on and the failure is counted).

In the spine, admission (auth to cache probe) and the final metrics + logs can be handed
to an `Admission` and a `Completions` object that decide many requests together (see
`monolith/spine_pipeline.py`); they use the same verdict functions
(`services.pipeline.verdicts`), so answers, codes and messages do not change.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from services.pipeline.verdicts import (
    FORWARDED_TRAILERS,
    MISSING_CREDENTIAL,
    RequestLimits,
    Stop,
    admission_stop,
    bearer,
    downstream_stop,
    rate_limit_cost,
    rate_limit_request,
    rate_limit_stop,
    resolved_request,
)
from spine.v1 import (
    auth_pb2,
    cache_pb2,
    gateway_pb2_grpc,
    generation_pb2,
    logs_pb2,
    metrics_pb2,
    router_pb2,
)

log = logging.getLogger("spine.gateway")

SHADOW_HEADER = "x-spine-shadow"
REQUEST_ID_HEADER = "x-request-id"
LAYOUT_HEADER = "x-spine-layout"


@dataclass
class Clients:
    """One client per component, each with its stub's call shape."""

    auth: Any
    ratelimit: Any
    router: Any
    cache: Any
    metrics: Any
    logs: Any
    inference: Any


_Stop = Stop  # raised inside the pipeline, turned into context.abort once


@dataclass
class RequestState:
    """What the gateway learns about one request as it goes down the pipeline."""

    request_id: str
    started: float
    deadline: float
    shadow: bool
    metadata: tuple[tuple[str, str], ...]
    tenant: str = ""
    model: str = ""
    status: str = "OK"
    cached: bool = False
    completion_tokens: int = 0
    middleware_s: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    cache_key: bytes | None = None  # the spine's batched probe keys a request once; its store reuses it

    def remaining(self) -> float:
        return max(0.001, self.deadline - time.monotonic())


Admitted = tuple[generation_pb2.GenerateRequest, generation_pb2.GenerateResponse | None]


class Admission(Protocol):
    """Decides auth → validation → router → ratelimit → cache probe for a request.

    Returns the resolved request and a cache hit (or None), or raises `Stop`; fills in the
    state's tenant, model, cache flag and middleware times as the gateway would.
    """

    def admit(self, request: generation_pb2.GenerateRequest, state: RequestState) -> Admitted: ...


class Completions(Protocol):
    """Takes a finished request's metrics record and log line before its answer goes out;
    they are counted before anyone reads the metrics or logs, and before shutdown ends."""

    def complete(self, state: RequestState, record: metrics_pb2.RequestRecord,
                 line: logs_pb2.LogRecord) -> None: ...

    def store(self, state: RequestState, request: generation_pb2.GenerateRequest,
              response: generation_pb2.GenerateResponse) -> bool:
        """Take a response for the cache (True), or leave it to the gateway (False)."""
        ...


class Gateway(gateway_pb2_grpc.GatewayServicer):
    """Serves `spine.v1.Gateway` by calling the middlewares in order."""

    def __init__(self, clients: Clients, limits: RequestLimits, layout: str) -> None:
        self.clients = clients
        self.limits = limits
        self.layout = layout
        self.fail_open_failures: Counter[str] = Counter()
        self._lock = threading.Lock()
        # The spine's batched stages; None: each middleware is called through its client.
        self.admission: Admission | None = None
        self.completions: Completions | None = None
        self.in_flight = 0  # requests begun and not finished: how many more a batch may expect

    # -- public API ---------------------------------------------------------------
    def Generate(self, request: generation_pb2.GenerateRequest, context: Any) -> generation_pb2.GenerateResponse:
        state = self._begin(context)
        try:
            resolved, cached = self._admit(request, state, context)
            if cached is not None:
                return cached
            trailers: list[tuple[str, str]] = []
            response = self._timed(state, "inference", self.clients.inference.Generate, resolved,
                                   fail_closed=True, parent=context, trailing_out=trailers)
            state.completion_tokens = response.completion_tokens
            self._store(state, resolved, response)
            context.set_trailing_metadata(self._trailing(state) + _forwarded(trailers))
            return response
        except _Stop as stop:
            self._abort(state, context, stop)
            raise AssertionError("unreachable") from None
        except Exception:
            if state.status == "OK":
                state.status = "INTERNAL"
            raise
        finally:
            self._finish(state)

    def GenerateStream(self, request: generation_pb2.GenerateRequest,
                       context: Any) -> Iterator[generation_pb2.GenerateChunk]:
        state = self._begin(context)
        try:
            resolved, cached = self._admit(request, state, context)
            if cached is not None:
                yield generation_pb2.GenerateChunk(text=cached.text, token_ids=cached.token_ids, index=0,
                                                   finish_reason=cached.finish_reason, cached=True,
                                                   model=cached.model)
                return
            tokens: list[int] = []
            texts: list[str] = []
            finish = ""
            started = time.perf_counter()
            stream = self._call_stream(state, resolved, context)
            try:
                for chunk in stream:
                    tokens.extend(chunk.token_ids)
                    texts.append(chunk.text)
                    finish = chunk.finish_reason or finish
                    yield chunk
            except grpc.RpcError as error:
                raise self._downstream_error("inference", error, fail_closed=True) from None
            finally:
                state.middleware_s["inference"] = state.middleware_s.get("inference", 0.0) + (
                    time.perf_counter() - started)
            state.completion_tokens = len(tokens)
            context.set_trailing_metadata(self._trailing(state) + _forwarded(stream.trailing_metadata() or ()))
            whole = generation_pb2.GenerateResponse(
                text="".join(texts), token_ids=tokens, model=resolved.model, finish_reason=finish,
                prompt_tokens=len(resolved.prompt.encode()), completion_tokens=len(tokens))
            self._store(state, resolved, whole)
        except _Stop as stop:
            self._abort(state, context, stop)
        except GeneratorExit:
            state.status = "CANCELLED"
            raise
        except Exception:
            if state.status == "OK":
                state.status = "INTERNAL"
            raise
        finally:
            self._finish(state)

    # -- the pipeline -------------------------------------------------------------
    def _abort(self, state: RequestState, context: Any, stop: Stop) -> None:
        """End the call with the pipeline's verdict; its trailers name layout and request id."""
        state.status = stop.code.name
        context.set_trailing_metadata(self._trailing(state) + stop.trailing)
        context.abort(stop.code, stop.details)

    def _begin(self, context: Any) -> RequestState:
        metadata = tuple(context.invocation_metadata() or ())
        md = dict(metadata)
        remaining = context.time_remaining()
        if remaining is None or remaining > 1e6:
            remaining = self.limits.default_deadline_s
        state = RequestState(
            request_id=_safe_request_id(md.get(REQUEST_ID_HEADER)),
            started=time.perf_counter(),
            deadline=time.monotonic() + remaining,
            shadow=md.get(SHADOW_HEADER, "") in ("1", "true"),
            metadata=metadata,
        )
        context.set_trailing_metadata(self._trailing(state))
        with self._lock:
            self.in_flight += 1
        return state

    def _admit(self, request: generation_pb2.GenerateRequest, state: RequestState,
               context: Any) -> Admitted:
        """Auth, validation, routing, rate limit and cache probe; the resolved request and a cache hit."""
        state.model = request.model
        admission = self.admission
        if admission is not None:
            return admission.admit(request, state)
        principal = self._authenticate(state)
        state.tenant = principal.tenant
        stop = admission_stop(request, principal, self.limits)
        if stop is not None:
            raise stop
        route = self._timed(state, "router", self.clients.router.Resolve,
                            router_pb2.ResolveRequest(model=request.model), fail_closed=True)
        state.model = route.model_id
        resolved = resolved_request(request, route.model_id)
        self._rate_limit(state, resolved)
        hit = self._lookup(state, resolved)
        return resolved, hit

    def _authenticate(self, state: RequestState) -> auth_pb2.Principal:
        credential = bearer(state.metadata)
        if credential is None:
            raise Stop(grpc.StatusCode.UNAUTHENTICATED, MISSING_CREDENTIAL)
        reply = self._timed(state, "auth", self.clients.auth.Check,
                            auth_pb2.CheckRequest(credential=credential), fail_closed=True)
        return reply.principal

    def _rate_limit(self, state: RequestState, request: generation_pb2.GenerateRequest) -> None:
        reply = self._timed(state, "ratelimit", self.clients.ratelimit.ShouldRateLimit,
                            rate_limit_request(state.tenant, request, state.shadow), fail_closed=True)
        stop = rate_limit_stop(reply, rate_limit_cost(request))
        if stop is not None:
            raise stop

    def _lookup(self, state: RequestState,
                request: generation_pb2.GenerateRequest) -> generation_pb2.GenerateResponse | None:
        reply = self._timed(state, "cache", self.clients.cache.Lookup,
                            cache_pb2.CacheLookupRequest(tenant=state.tenant, request=request), fail_closed=False)
        if reply is None or not reply.hit:
            return None
        state.cached = True
        state.completion_tokens = reply.response.completion_tokens
        return reply.response

    def _store(self, state: RequestState, request: generation_pb2.GenerateRequest,
               response: generation_pb2.GenerateResponse) -> None:
        if state.shadow:
            return  # shadow traffic never writes to the real cache
        completions = self.completions
        if completions is not None and completions.store(state, request, response):
            return  # the spine stores it off the request path, before any later lookup
        self._timed(state, "cache", self.clients.cache.Store,
                    cache_pb2.CacheStoreRequest(tenant=state.tenant, request=request, response=response),
                    fail_closed=False)

    def _finish(self, state: RequestState) -> None:
        """Metrics and logs for every request, whatever its outcome (both fail open)."""
        with self._lock:
            self.in_flight -= 1
        latency = time.perf_counter() - state.started
        record = metrics_pb2.RequestRecord(
            layout=self.layout, model=state.model, tenant=state.tenant, status=state.status, latency_s=latency,
            middleware_s=state.middleware_s, cached=state.cached, shadow=state.shadow,
            completion_tokens=state.completion_tokens)
        if state.failures:
            record.failed_middlewares.extend(state.failures)
        line = logs_pb2.LogRecord(
            request_id=state.request_id, tenant=state.tenant, model=state.model, status=state.status,
            latency_ms=latency * 1000.0, layout=self.layout, cached=state.cached, shadow=state.shadow)
        completions = self.completions
        if completions is not None:
            completions.complete(state, record, line)
            return
        self._timed(state, "metrics", self.clients.metrics.Record, record, fail_closed=False, final=True)
        self._timed(state, "logs", self.clients.logs.Append, line, fail_closed=False, final=True)

    def count_fail_open(self, name: str, reason: str, request_id: str) -> None:
        """Count a fail-open middleware's failure (also for failures in a batched stage)."""
        with self._lock:
            self.fail_open_failures[name] += 1
        log.warning("fail-open middleware %s failed (%s); request %s goes on", name, reason, request_id)

    # -- calling the middlewares ----------------------------------------------------
    def _timed(self, state: RequestState, name: str, method: Any, message: Any, *, fail_closed: bool,
               parent: Any = None, final: bool = False, **extra: Any) -> Any:
        started = time.perf_counter()
        timeout = 1.0 if final else state.remaining()  # metrics/logs must not hang a finished request
        try:
            return method(message, timeout=timeout, metadata=((REQUEST_ID_HEADER, state.request_id),),
                          parent=parent, **extra)
        except grpc.RpcError as error:
            if fail_closed:
                raise self._downstream_error(name, error, fail_closed=True) from None
            self._count_failure(state, name, error)
            return None
        finally:
            state.middleware_s[name] = state.middleware_s.get(name, 0.0) + (time.perf_counter() - started)

    def _call_stream(self, state: RequestState, request: generation_pb2.GenerateRequest, context: Any) -> Any:
        try:
            return self.clients.inference.GenerateStream(
                request, timeout=state.remaining(), metadata=((REQUEST_ID_HEADER, state.request_id),),
                parent=context)
        except grpc.RpcError as error:
            raise self._downstream_error("inference", error, fail_closed=True) from None

    def _downstream_error(self, name: str, rpc_error: grpc.RpcError, *, fail_closed: bool) -> Stop:
        error: Any = rpc_error  # a grpc.Call as well, for remote and local bindings alike
        code = error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNKNOWN
        details = str(error.details() if callable(getattr(error, "details", None)) else error)
        trailing = tuple(error.trailing_metadata() or ()) if hasattr(error, "trailing_metadata") else ()
        return downstream_stop(name, code, details, trailing)

    def _count_failure(self, state: RequestState, name: str, error: grpc.RpcError) -> None:
        state.failures.append(name)
        code = error.code() if callable(getattr(error, "code", None)) else None
        self.count_fail_open(name, str(getattr(code, "name", code)), state.request_id)

    def _trailing(self, state: RequestState) -> tuple[tuple[str, str], ...]:
        return ((LAYOUT_HEADER, self.layout), (REQUEST_ID_HEADER, state.request_id))


def _forwarded(trailing: Any) -> tuple[tuple[str, str], ...]:
    """The downstream trailers the client should see (load hints), nothing else."""
    return tuple((k, v) for k, v in trailing if k in FORWARDED_TRAILERS)


def _safe_request_id(value: str | None) -> str:
    """Keep a caller's request id when it is short and plain; otherwise make one."""
    if value and len(value) <= 64 and all(c.isalnum() or c in "-_." for c in value):
        return value
    return f"{_ID_PREFIX}{next(_ID_SEQUENCE):012x}"


# Request ids: a random per-process prefix (80 bits) and a counter — unique across
# processes and restarts like a uuid4, without a system call per request.
_ID_PREFIX = secrets.token_hex(10)
_ID_SEQUENCE = itertools.count()
