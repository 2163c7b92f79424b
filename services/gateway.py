"""The Gateway: the public API, and the one place where the pipeline's order lives.

The gateway calls each middleware through a client with the stub's call shape. Whether
that client is a gRPC stub to another process or a direct call into the same process is
decided by the runtime (the bindings), never here — so both layouts run this exact code
and decide identically.

Order: auth → validate → router → ratelimit → cache → inference → cache store, and
metrics + logs for every request, whatever its outcome. Auth, router, ratelimit and
inference fail closed (UNAVAILABLE when they cannot answer); cache, metrics and logs fail
open (the request goes on and the failure is counted).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from services.gateway_limits import RequestLimits, validation_error
from services.ratelimit import descriptors_for
from spine.v1 import (
    auth_pb2,
    cache_pb2,
    gateway_pb2_grpc,
    generation_pb2,
    logs_pb2,
    metrics_pb2,
    ratelimit_pb2,
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


class _Stop(Exception):
    """Ends the pipeline with a status (raised inside, turned into context.abort once)."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str], ...] = ()):
        super().__init__(details)
        self.code = code
        self.details = details
        self.trailing = trailing


@dataclass
class _Request:
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

    def remaining(self) -> float:
        return max(0.001, self.deadline - time.monotonic())


class Gateway(gateway_pb2_grpc.GatewayServicer):
    """Serves `spine.v1.Gateway` by calling the middlewares in order."""

    def __init__(self, clients: Clients, limits: RequestLimits, layout: str) -> None:
        self.clients = clients
        self.limits = limits
        self.layout = layout
        self.fail_open_failures: Counter[str] = Counter()
        self._lock = threading.Lock()

    # -- public API ---------------------------------------------------------------
    def Generate(self, request: generation_pb2.GenerateRequest, context: Any) -> generation_pb2.GenerateResponse:
        state = self._begin(context)
        try:
            resolved, cached = self._admit(request, state, context)
            if cached is not None:
                return cached
            response = self._timed(state, "inference", self.clients.inference.Generate, resolved,
                                   fail_closed=True, parent=context)
            state.completion_tokens = response.completion_tokens
            self._store(state, resolved, response)
            return response
        except _Stop as stop:
            state.status = stop.code.name
            context.set_trailing_metadata(self._trailing(state) + stop.trailing)
            context.abort(stop.code, stop.details)
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
            whole = generation_pb2.GenerateResponse(
                text="".join(texts), token_ids=tokens, model=resolved.model, finish_reason=finish,
                prompt_tokens=len(resolved.prompt.encode()), completion_tokens=len(tokens))
            self._store(state, resolved, whole)
        except _Stop as stop:
            state.status = stop.code.name
            context.set_trailing_metadata(self._trailing(state) + stop.trailing)
            context.abort(stop.code, stop.details)
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
    def _begin(self, context: Any) -> _Request:
        metadata = tuple(context.invocation_metadata() or ())
        md = dict(metadata)
        remaining = context.time_remaining()
        if remaining is None or remaining > 1e6:
            remaining = self.limits.default_deadline_s
        state = _Request(
            request_id=_safe_request_id(md.get(REQUEST_ID_HEADER)),
            started=time.perf_counter(),
            deadline=time.monotonic() + remaining,
            shadow=md.get(SHADOW_HEADER, "") in ("1", "true"),
            metadata=metadata,
        )
        context.set_trailing_metadata(self._trailing(state))
        return state

    def _admit(self, request: generation_pb2.GenerateRequest, state: _Request,
               context: Any) -> tuple[generation_pb2.GenerateRequest, generation_pb2.GenerateResponse | None]:
        """Auth, validation, routing, rate limit and cache probe; the resolved request and a cache hit."""
        state.model = request.model
        principal = self._authenticate(state)
        state.tenant = principal.tenant
        problem = validation_error(request, self.limits)
        if problem is not None:
            raise _Stop(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if request.priority > principal.max_priority:
            raise _Stop(grpc.StatusCode.PERMISSION_DENIED,
                        f"priority: {request.priority} is above tenant {principal.tenant!r}'s allowance of "
                        f"{principal.max_priority}")
        route = self._timed(state, "router", self.clients.router.Resolve,
                            router_pb2.ResolveRequest(model=request.model), fail_closed=True)
        state.model = route.model_id
        resolved = generation_pb2.GenerateRequest()
        resolved.CopyFrom(request)
        resolved.model = route.model_id
        self._rate_limit(state, resolved)
        hit = self._lookup(state, resolved)
        return resolved, hit

    def _authenticate(self, state: _Request) -> auth_pb2.Principal:
        credential = _bearer(state.metadata)
        if credential is None:
            raise _Stop(grpc.StatusCode.UNAUTHENTICATED,
                        "missing credential: send 'authorization: Bearer <api key or JWT>' metadata")
        reply = self._timed(state, "auth", self.clients.auth.Check,
                            auth_pb2.CheckRequest(credential=credential), fail_closed=True)
        return reply.principal

    def _rate_limit(self, state: _Request, request: generation_pb2.GenerateRequest) -> None:
        cost = len(request.prompt.encode()) + request.max_tokens
        reply = self._timed(state, "ratelimit", self.clients.ratelimit.ShouldRateLimit,
                            ratelimit_pb2.RateLimitRequest(domain="spine", descriptors=descriptors_for(
                                state.tenant, request.model, cost), dry_run=state.shadow), fail_closed=True)
        if reply.overall_code != ratelimit_pb2.RateLimitResponse.OVER_LIMIT:
            return
        over = [s for s in reply.statuses if s.code == ratelimit_pb2.RateLimitResponse.OVER_LIMIT]
        names = ", ".join(s.limit_name for s in over) or "rate limit"
        if any(s.retry_after_s < 0 for s in over):
            raise _Stop(grpc.StatusCode.INVALID_ARGUMENT,
                        f"request costs {cost} tokens, more than the bucket can ever hold ({names}); "
                        "lower max_tokens or shorten the prompt")
        retry = max(reply.retry_after_s, 0.0)
        raise _Stop(grpc.StatusCode.RESOURCE_EXHAUSTED, f"rate limited by {names}; retry after {retry:.3f}s",
                    (("retry-after", f"{retry:.3f}"),))

    def _lookup(self, state: _Request,
                request: generation_pb2.GenerateRequest) -> generation_pb2.GenerateResponse | None:
        reply = self._timed(state, "cache", self.clients.cache.Lookup,
                            cache_pb2.CacheLookupRequest(tenant=state.tenant, request=request), fail_closed=False)
        if reply is None or not reply.hit:
            return None
        state.cached = True
        state.completion_tokens = reply.response.completion_tokens
        return reply.response

    def _store(self, state: _Request, request: generation_pb2.GenerateRequest,
               response: generation_pb2.GenerateResponse) -> None:
        if state.shadow:
            return  # shadow traffic never writes to the real cache
        self._timed(state, "cache", self.clients.cache.Store,
                    cache_pb2.CacheStoreRequest(tenant=state.tenant, request=request, response=response),
                    fail_closed=False)

    def _finish(self, state: _Request) -> None:
        """Metrics and logs for every request, whatever its outcome (both fail open)."""
        latency = time.perf_counter() - state.started
        record = metrics_pb2.RequestRecord(
            layout=self.layout, model=state.model, tenant=state.tenant, status=state.status, latency_s=latency,
            middleware_s=state.middleware_s, cached=state.cached, shadow=state.shadow,
            completion_tokens=state.completion_tokens)
        if state.failures and "failed_middlewares" in metrics_pb2.RequestRecord.DESCRIPTOR.fields_by_name:
            record.failed_middlewares.extend(state.failures)
        self._timed(state, "metrics", self.clients.metrics.Record, record, fail_closed=False, final=True)
        self._timed(state, "logs", self.clients.logs.Append, logs_pb2.LogRecord(
            request_id=state.request_id, tenant=state.tenant, model=state.model, status=state.status,
            latency_ms=latency * 1000.0, layout=self.layout, cached=state.cached, shadow=state.shadow),
            fail_closed=False, final=True)

    # -- calling the middlewares ----------------------------------------------------
    def _timed(self, state: _Request, name: str, method: Any, message: Any, *, fail_closed: bool,
               parent: Any = None, final: bool = False) -> Any:
        started = time.perf_counter()
        timeout = 1.0 if final else state.remaining()  # metrics/logs must not hang a finished request
        try:
            return method(message, timeout=timeout, metadata=((REQUEST_ID_HEADER, state.request_id),),
                          parent=parent)
        except grpc.RpcError as error:
            if fail_closed:
                raise self._downstream_error(name, error, fail_closed=True) from None
            self._count_failure(state, name, error)
            return None
        finally:
            state.middleware_s[name] = state.middleware_s.get(name, 0.0) + (time.perf_counter() - started)

    def _call_stream(self, state: _Request, request: generation_pb2.GenerateRequest, context: Any) -> Any:
        try:
            return self.clients.inference.GenerateStream(
                request, timeout=state.remaining(), metadata=((REQUEST_ID_HEADER, state.request_id),),
                parent=context)
        except grpc.RpcError as error:
            raise self._downstream_error("inference", error, fail_closed=True) from None

    def _downstream_error(self, name: str, rpc_error: grpc.RpcError, *, fail_closed: bool) -> _Stop:
        error: Any = rpc_error  # a grpc.Call as well, for remote and local bindings alike
        code = error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNKNOWN
        details = str(error.details() if callable(getattr(error, "details", None)) else error)
        if code in _PASS_THROUGH.get(name, ()):
            trailing = tuple(error.trailing_metadata() or ()) if hasattr(error, "trailing_metadata") else ()
            return _Stop(code, details, tuple((k, v) for k, v in trailing if k == "retry-after"))
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return _Stop(code, f"deadline exceeded while waiting for {name}")
        return _Stop(grpc.StatusCode.UNAVAILABLE, f"{name} unavailable ({code.name}: {details})")

    def _count_failure(self, state: _Request, name: str, error: grpc.RpcError) -> None:
        state.failures.append(name)
        with self._lock:
            self.fail_open_failures[name] += 1
        code = error.code() if callable(getattr(error, "code", None)) else None
        log.warning("fail-open middleware %s failed (%s); request %s goes on", name,
                    getattr(code, "name", code), state.request_id)

    def _trailing(self, state: _Request) -> tuple[tuple[str, str], ...]:
        return ((LAYOUT_HEADER, self.layout), (REQUEST_ID_HEADER, state.request_id))


_PASS_THROUGH: dict[str, tuple[grpc.StatusCode, ...]] = {
    "auth": (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED),
    "router": (grpc.StatusCode.NOT_FOUND,),
    "ratelimit": (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED),
    "inference": (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED,
                  grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED, grpc.StatusCode.NOT_FOUND),
}


def _bearer(metadata: tuple[tuple[str, str], ...]) -> str | None:
    for key, value in metadata:
        if key == "authorization":
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


def _safe_request_id(value: str | None) -> str:
    """Keep a caller's request id when it is short and plain; otherwise make one."""
    if value and len(value) <= 64 and all(c.isalnum() or c in "-_." for c in value):
        return value
    return uuid.uuid4().hex
