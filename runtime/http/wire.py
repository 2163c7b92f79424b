"""What both HTTP APIs share: status codes for the pipeline's verdicts, the request's metadata
from its headers, and the headers every answer carries.

The pipeline decides in gRPC status codes (`services.pipeline.verdicts`); an HTTP client
gets the code its SDK maps to the right exception class:

| gRPC | HTTP | openai / anthropic SDK |
|---|---|---|
| INVALID_ARGUMENT, OUT_OF_RANGE, FAILED_PRECONDITION | 400 | BadRequestError |
| UNAUTHENTICATED | 401 | AuthenticationError |
| PERMISSION_DENIED | 403 | PermissionDeniedError |
| NOT_FOUND | 404 | NotFoundError |
| RESOURCE_EXHAUSTED from the rate limiter | 429 + Retry-After | RateLimitError |
| RESOURCE_EXHAUSTED `budget exhausted…` (a key's, team's or tenant's budget) | 429, OpenAI's `insufficient_quota`, + `x-should-retry: false` and Retry-After (when the window starts again) | RateLimitError, not retried |
| RESOURCE_EXHAUSTED elsewhere (the model's queue is full), UNAVAILABLE | 503 (OpenAI) / 529 (Anthropic) + Retry-After where known | InternalServerError / OverloadedError |
| DEADLINE_EXCEEDED | 504 | InternalServerError |
| FAILED_PRECONDITION `content_policy_violation…` (the output policy) | 400, the body existing clients of the policy expect, `{"error": "content_policy_violation", "suggestion": "rephrase"}` | BadRequestError |
| anything else | 500 | InternalServerError |

`Retry-After` is whole seconds (rounded up, as HTTP requires) and `retry-after-ms` the exact
figure, which both official SDKs read first.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import grpc
import orjson

from services.inference.load_hints import FALLBACK_HEADER, LOAD_HEADER, parse_load
from services.inference.output_policy import VIOLATION, VIOLATION_CODE
from services.pipeline.internal_marks import SHADOW_HEADER
from services.pipeline.verdicts import (
    ATTEMPTS_HEADER,
    BUDGET_HEADER,
    BUDGET_PREFIX,
    OVERHEAD_HEADER,
    UPSTREAM_HEADER,
    UPSTREAM_TIME_HEADER,
    USAGE_HEADER,
)

REQUEST_ID = "x-request-id"
LAYOUT = "x-spine-layout"
GPU_LOAD_HINT = "x-gpu-load-hint"  # what GPU-serving clients read: the load hint as JSON
# Headers a client may send that reach the pipeline as metadata (besides the credential and
# `x-request-id`, which the app reads itself). Nothing else does: a client cannot name
# internal metadata (a tenant) by sending a header. The shadow mark passes because it is
# signed: the gateway honours it only when it verifies with the deployment's internal
# secret (`services.pipeline.internal_marks`), so the HTTP front's copies to the spine are
# dry-run there, and whatever else a client puts in it is ignored.
FORWARDED_HEADERS = ("x-session-id", "x-spine-route", "traceparent", "tracestate", SHADOW_HEADER)
RATE_LIMITED_PREFIX = "rate limited by"  # the rate limiter's refusals (`verdicts.rate_limit_stop`)
INSUFFICIENT_QUOTA = "insufficient_quota"  # a budget's refusal: OpenAI's own type and code for it
MAX_INT32 = 2**31 - 1


@dataclass
class HttpError(Exception):
    """An answer that is not a success: its HTTP status, the API's error type and a message
    a person can act on, and the headers it carries (retry-after, the usual trailers)."""

    status: int
    kind: str  # what the API calls it: "invalid_request_error", "rate_limit_error", ...
    message: str
    headers: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        return f"{self.status} {self.kind}: {self.message}"


# The output policy's verdict (`services.inference.output_policy`): answered in the shape existing clients of the policy expect,
# `{"error": "content_policy_violation", "suggestion": "rephrase"}`, in both APIs.
POLICY_VIOLATION = "content_policy_violation"


def policy_violation_body(error: HttpError, request_id: str) -> dict[str, str]:
    return {"error": POLICY_VIOLATION, "suggestion": "rephrase", "message": error.message, "request_id": request_id}


def bad_request(message: str) -> HttpError:
    return HttpError(400, "invalid_request_error", message)


_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
}


def status_for(code: grpc.StatusCode, details: str, overloaded_status: int) -> tuple[int, str]:
    """The HTTP status and error type for a pipeline verdict (`overloaded_status`: the API's
    own code for "try again soon": 503 for OpenAI, 529 for Anthropic)."""
    if code == VIOLATION_CODE and details.startswith(VIOLATION):
        return 400, POLICY_VIOLATION
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        if details.startswith(RATE_LIMITED_PREFIX):
            return 429, "rate_limit_error"
        if details.startswith(BUDGET_PREFIX):
            return 429, INSUFFICIENT_QUOTA
        return overloaded_status, "overloaded_error"
    if code == grpc.StatusCode.UNAVAILABLE:
        return overloaded_status, "overloaded_error"
    return _STATUS.get(code, (500, "api_error"))


def retry_headers(trailing: Mapping[str, str]) -> list[tuple[str, str]]:
    """`retry-after` (whole seconds, at least 1) and `retry-after-ms` from the verdict's trailer."""
    raw = trailing.get("retry-after")
    if raw is None:
        return []
    try:
        seconds = max(0.0, float(raw))
    except ValueError:
        return []
    if not math.isfinite(seconds):
        return []
    return [("retry-after", str(max(1, math.ceil(seconds)))), ("retry-after-ms", str(round(seconds * 1000)))]


def load_hint_json(hint: str | None) -> str:
    """`X-GPU-Load-Hint` (the header GPU-serving clients read): the routed model's load hint as a JSON object — `sm_util`
    (the GPU's utilisation in percent; the decode loop's busy share where there is no GPU
    figure) and `vram_free_gb`, then the spine's own fields; nulls when no hint is known."""
    values = parse_load(hint)
    if not values:
        return '{"sm_util":null,"vram_free_gb":null}'
    util = values.get("util", values["busy"] * 100.0 if "busy" in values else None)
    free_mb = values.get("mem_free_mb")
    out: dict[str, float | int | None] = {
        "sm_util": None if util is None else round(util, 1),
        "vram_free_gb": None if free_mb is None else round(free_mb / 1024.0, 3),
    }
    for key in ("queue", "running", "slots", "kv_free"):
        if key in values:
            out[key] = int(values[key])
    for key in ("ms_per_token", "busy"):
        if key in values:
            out[key] = values[key]
    return orjson.dumps(out).decode()


# What an answer's headers take from its trailing metadata, when there.
ANSWER_HEADERS = (REQUEST_ID, LAYOUT, LOAD_HEADER, FALLBACK_HEADER, "x-spine-side", OVERHEAD_HEADER, UPSTREAM_HEADER,
                  ATTEMPTS_HEADER, UPSTREAM_TIME_HEADER, USAGE_HEADER, BUDGET_HEADER)
# The usage field that says whose count of tokens an upstream model's answer carries.
COUNTED_BY = "spine_counted_by"


def answer_headers(trailing: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The headers every answer carries, errors included, from the call's trailing metadata:
    request id, layout, the load hint (as the gateway's `x-spine-load` and as JSON), the
    routed model's fallback, the side the front chose, the time spent outside the model, and
    for a model served by an upstream server which one answered after how many attempts."""
    md = dict(trailing)
    out = [(key, md[key]) for key in ANSWER_HEADERS if key in md]
    out.append((GPU_LOAD_HINT, load_hint_json(md.get(LOAD_HEADER))))
    return out


def request_metadata(headers: Iterable[tuple[bytes, bytes]]) -> tuple[tuple[str, str], ...]:
    """The pipeline's metadata from an HTTP request's headers: the credential as gRPC's
    `authorization: Bearer KEY` (from `Authorization` or Anthropic's `x-api-key`), and the
    few headers a client may set (`FORWARDED_HEADERS`). Raises HttpError for a header that is
    not text or a credential given twice."""
    credentials: list[str] = []
    out: list[tuple[str, str]] = []
    for raw_name, raw_value in headers:
        name = raw_name.decode("latin-1").lower()
        if name not in ("authorization", "x-api-key") and name not in FORWARDED_HEADERS:
            continue
        try:
            value = raw_value.decode("ascii").strip()
        except UnicodeDecodeError:
            raise bad_request(f"header {name}: must be ASCII text") from None
        if not value.isprintable():
            raise bad_request(f"header {name}: must be printable text")
        if name == "authorization":
            credentials.append(value)
        elif name == "x-api-key":
            credentials.append(f"Bearer {value}")
        else:
            out.append((name, value))
    if len(set(credentials)) > 1:
        raise HttpError(401, "authentication_error",
                        "malformed credential: send one of Authorization: Bearer KEY or x-api-key: KEY, once")
    if credentials:
        out.append(("authorization", credentials[0]))
    return tuple(out)
