"""A gateway's verdict, read from the `grpc.RpcError` it raised, as the API's HTTP error.

The gateway speaks gRPC status codes in every layout; the status an HTTP client sees is each
API's own (OpenAI and Anthropic differ on overload), so a verdict is kept as its code until the
API answering it chooses the status (`with_status`), with the retry headers that status
promises. A failure no verdict named is INTERNAL, logged once a second at most, never with
what the client sent.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import grpc

from runtime.http.wire import INSUFFICIENT_QUOTA, HttpError, retry_headers, status_for
from services.common.log_limit import RateLimitedLog
from services.gateway.request_ids import REQUEST_ID_HEADER
from services.pipeline.pipeline import code_details

log = logging.getLogger("spine.http")
# A gateway that fails every request: each traceback at DEBUG, at most one ERROR line a second.
_gateway_failures = RateLimitedLog(log, "requests the gateway failed", level=logging.ERROR)


class Verdict(HttpError):
    """A pipeline verdict before its API chose the HTTP status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(0, "", details)
        self.code = code


def verdict_of(error: grpc.RpcError) -> Verdict:
    code, details, _ = code_details(error)  # the pipeline's own reading of an RpcError
    return Verdict(code, details)


def with_status(error: HttpError, api: Any, trailing: Iterable[tuple[str, str]]) -> HttpError:
    if not isinstance(error, Verdict):
        return error
    status, kind = status_for(error.code, error.message, api.OVERLOADED_STATUS)
    retry = retry_headers(dict(trailing)) if status in (429, api.OVERLOADED_STATUS) else []
    if kind == INSUFFICIENT_QUOTA:  # a spent budget: the SDKs' own retries would only be refused again
        retry.append(("x-should-retry", "false"))
    return HttpError(status, kind, error.message, tuple(retry))


def gateway_failed(metadata: Iterable[tuple[str, str | bytes]]) -> Verdict:
    """An error the gateway raised that no verdict named: logged (rate-limited, with its
    traceback at DEBUG), and INTERNAL for the client, who learns nothing of its cause."""
    _gateway_failures(None, "request %s: the gateway failed", dict(metadata).get(REQUEST_ID_HEADER), exc_info=True)
    return Verdict(grpc.StatusCode.INTERNAL, "internal error")
