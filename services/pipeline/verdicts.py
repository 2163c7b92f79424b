"""The pipeline's verdicts: every status code a client can get, decided in one place.

Each step turns what its component answered into a `Stop` (or nothing) with these
functions, whatever the batch size and wherever the component runs, so a request gets the
same status, message and trailers in every layout. Parity between layouts depends on
there being exactly one copy of each.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Sequence
from typing import Any

import grpc

from services.pipeline.limits import RequestLimits
from services.pipeline.request_shape import tool_definition_bytes
from services.pipeline.system_prompt import system_error
from wire.v1 import auth_pb2, generation_pb2

PRIORITIES = (-1, 0, 1)
CHAT_ROLES = ("system", "user", "assistant")
MISSING_CREDENTIAL = "missing credential: send 'authorization: Bearer <api key or JWT>' metadata"


class Stop(Exception):
    """Ends one request's pipeline with a status (turned into context.abort once, at the top)."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str], ...] = ()):
        super().__init__(details)
        self.code = code
        self.details = details
        self.trailing = trailing


def validation_error(request: generation_pb2.GenerateRequest, limits: RequestLimits) -> str | None:
    """The first problem with a request, as a message naming the field; None when valid."""
    if not request.model:
        return "model: required (e.g. 'tiny-lm')"
    if not request.prompt and not request.body:  # a chat of images alone has no text, but a body
        return "prompt: must not be empty"
    sized = limits.for_model(request.model)
    if len(request.prompt) > sized.max_prompt_chars:
        return (f"prompt: {len(request.prompt)} characters is over the limit of {sized.max_prompt_chars} for "
                f"model {request.model!r} ({sized.source})")
    problem = system_error(request.system, limits.max_system_chars)
    if problem is not None:
        return problem
    for index, message in enumerate(request.messages):
        if message.role not in CHAT_ROLES:
            return f"messages[{index}].role: must be one of {', '.join(CHAT_ROLES)}, got {message.role[:32]!r}"
    if request.max_tokens <= 0:
        return f"max_tokens: must be > 0, got {request.max_tokens}"
    if request.max_tokens > sized.max_tokens:
        return (f"max_tokens: {request.max_tokens} is over the limit of {sized.max_tokens} for model "
                f"{request.model!r} ({sized.source})")
    if not math.isfinite(request.temperature) or not 0.0 <= request.temperature <= limits.max_temperature:
        return f"temperature: must be between 0 and {limits.max_temperature}, got {request.temperature}"
    if request.priority not in PRIORITIES:
        return f"priority: must be one of {PRIORITIES}, got {request.priority}"
    return inference_timeout_error(request.inference_timeout_ms, limits.max_inference_timeout_ms)


def inference_timeout_error(asked: int, cap: int) -> str | None:
    """What is wrong with a compute budget asked for (0 = the server's default); None if fine.

    The gateway checks it before the cache (a cached answer must not accept what the model
    would refuse) and the model checks it again; both with `inference.max_timeout_ms`."""
    if asked < 0:
        return f"inference_timeout_ms: must be >= 0 (0 = the server default), got {asked}"
    if asked > cap:
        return f"inference_timeout_ms: {asked} is above the cap of {cap} ms (inference.max_timeout_ms)"
    return None


def bearer(metadata: Sequence[tuple[str, str]]) -> str | None:
    """The bearer token in `authorization` metadata, or None."""
    for key, value in metadata:
        if key == "authorization":
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


def admission_stop(request: generation_pb2.GenerateRequest, principal: auth_pb2.Principal,
                   limits: RequestLimits) -> Stop | None:
    """What stops an authenticated request before routing: bad input, then a priority too high."""
    problem = validation_error(request, limits)
    if problem is not None:
        return Stop(grpc.StatusCode.INVALID_ARGUMENT, problem)
    if request.priority > principal.max_priority:
        return Stop(grpc.StatusCode.PERMISSION_DENIED,
                    f"priority: {request.priority} is above tenant {principal.tenant!r}'s allowance of "
                    f"{principal.max_priority}")
    return None


def resolved_request(request: generation_pb2.GenerateRequest, model_id: str) -> generation_pb2.GenerateRequest:
    """A copy of `request` naming the routed model (what the limits, cache and model see)."""
    resolved = generation_pb2.GenerateRequest()
    resolved.CopyFrom(request)
    resolved.model = model_id
    return resolved


def rate_limit_cost(request: generation_pb2.GenerateRequest) -> int:
    """Tokens charged for a request at admission: its prompt and system prompt bytes, and its
    tool definitions' (prompt the engine reads too). What it generates is charged at its end,
    when the model has said how much (the release step settles the tokens bucket with the
    real usage, streams and aborted streams included; an engine's usage counts its images)."""
    return len(request.prompt.encode()) + len(request.system.encode()) + tool_definition_bytes(request)


# The least budget (USD) left to the key, team or tenant of a request, on every answer where
# one applies; and the start of a budget refusal's message (what the HTTP API reads it by).
BUDGET_HEADER = "x-spine-budget-remaining-usd"
BUDGET_PREFIX = "budget exhausted"


def rate_limit_stop(verdict: Any, cost: int) -> Stop | None:
    """None when admitted; else the refusal (never-fits is bad input, over the limit is retryable).

    `verdict`: the rate limiter's answer (`services.ratelimit.admission.AdmitVerdict`, or
    the `AdmitResponse` it encodes to): `admitted`, `retry_after_s`, and `over`, the limits
    not fitted, each with `limit_name` and `retry_after_s`."""
    if verdict.admitted:
        return None
    if getattr(verdict, "budget", ""):
        # A refusal says 0 left: what remains (a fraction of a cent the prompt alone would pass)
        # is nothing a request like this one can use until the window starts again; the message
        # says how much is spent (docs/keys-and-budgets.md).
        resets = max(verdict.budget_resets_in_s, 0.0)
        return Stop(grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{BUDGET_PREFIX}: {verdict.budget}; it starts again in {resets:.0f}s",
                    (("retry-after", f"{resets:.3f}"), (BUDGET_HEADER, "0")))
    names = ", ".join(over.limit_name for over in verdict.over) or "rate limit"
    if any(over.retry_after_s < 0 for over in verdict.over):
        return Stop(grpc.StatusCode.INVALID_ARGUMENT,
                    f"request costs {cost} tokens, more than the bucket can ever hold ({names}); "
                    "shorten the prompt")
    retry = max(verdict.retry_after_s, 0.0)
    return Stop(grpc.StatusCode.RESOURCE_EXHAUSTED, f"rate limited by {names}; retry after {retry:.3f}s",
                (("retry-after", f"{retry:.3f}"),))


# Trailing metadata a downstream answer hands on to the client: when to retry, how loaded
# the model is (x-spine-load, read by spine.client.overload_client), and for a model served
# by an upstream server which one answered, after how many attempts, and the time it took
# (`services.inference.upstream.service`).
UPSTREAM_HEADER = "x-spine-upstream"
ATTEMPTS_HEADER = "x-spine-attempts"
UPSTREAM_TIME_HEADER = "x-spine-upstream-duration-ms"
# Whose count of tokens an upstream model's answer carries: `upstream` or `estimate`
# (`services.common.token_estimate`); the HTTP API says it in the answer's usage.
USAGE_HEADER = "x-spine-usage"
FORWARDED_TRAILERS = ("retry-after", "x-spine-load", UPSTREAM_HEADER, ATTEMPTS_HEADER, UPSTREAM_TIME_HEADER,
                      USAGE_HEADER)
# Every answer's time outside the model (the gateway's own work), in milliseconds: the peer
# gateways' convention (LiteLLM's x-litellm-overhead-duration-ms).
OVERHEAD_HEADER = "x-spine-overhead-duration-ms"


def downstream_stop(name: str, code: grpc.StatusCode, details: str,
                    trailing: Sequence[tuple[str, str]] = (), passes: Collection[grpc.StatusCode] = ()) -> Stop:
    """A fail-closed middleware's failure as the client sees it: a code it `passes` (its own
    verdict, e.g. auth's UNAUTHENTICATED) as it is, a deadline as a deadline, anything else
    as UNAVAILABLE naming the middleware."""
    forwarded = tuple((k, v) for k, v in trailing if k in FORWARDED_TRAILERS)
    if code in passes:
        return Stop(code, details, forwarded)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return Stop(code, f"deadline exceeded while waiting for {name}", forwarded)
    return Stop(grpc.StatusCode.UNAVAILABLE, f"{name} unavailable ({code.name}: {internal_addresses_hidden(details)})",
                forwarded)


# A transport error names the socket or address it could not reach: a client has no use
# for where the internal components live, and an attacker would.
_INTERNAL_ADDRESS = re.compile(r"(?:unix(?:-abstract)?:|ipv[46]:)\S+?(?=[\s,;)]|: |$)|/[\w./-]*\.sock\b")


def internal_addresses_hidden(details: str) -> str:
    """`details` with socket paths and internal addresses replaced by a placeholder."""
    return _INTERNAL_ADDRESS.sub("<internal address>", details)
