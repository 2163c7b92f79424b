"""A request's walk over its upstreams is one plan, whether its attempts are waited for in a
thread (`Walk.run`) or awaited on an event loop (`Walk.run_on_loop`): the same retries, the
same fallback, the same verdicts; and on a loop the client's leaving ends a backoff at once."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from services.common.upstream_config import UpstreamSpec
from services.inference.upstream import attempts
from services.inference.upstream.attempts import Cancelled, Walk
from services.inference.upstream.endpoint import UpstreamEndpoint
from services.inference.upstream.failures import AttemptFailure, Kind
from services.pipeline.local_context import LocalContext


def _endpoints(**primary: Any) -> dict[str, UpstreamEndpoint]:
    spec = UpstreamSpec(base_url="http://127.0.0.1:9/v1", fallbacks=["backup"], **primary)
    return {"primary": UpstreamEndpoint("primary", spec),
            "backup": UpstreamEndpoint("backup", UpstreamSpec(base_url="http://127.0.0.1:9/v1"))}


def _script(failures: int) -> tuple[list[str], Any]:
    """Attempts that fail `failures` times on the primary (a 5xx), then answer with the name tried."""
    tried: list[str] = []

    def attempt(endpoint: UpstreamEndpoint, timeout_s: float) -> str:
        tried.append(endpoint.model_id)
        if endpoint.model_id == "primary" and len(tried) <= failures:
            raise AttemptFailure(Kind.FAILED, f"{endpoint!r} answered 500", 500)
        return endpoint.model_id

    return tried, attempt


@pytest.mark.parametrize("failures", [0, 1, 5])
def test_the_awaited_walk_takes_the_same_path_as_the_blocking_one(failures: int) -> None:
    blocking_tried, blocking_attempt = _script(failures)
    blocking = Walk(_endpoints(retries=2), "primary", LocalContext())
    blocking_answer = blocking.run(blocking_attempt)

    awaited_tried, awaited_attempt = _script(failures)

    async def attempt(endpoint: UpstreamEndpoint, timeout_s: float) -> str:
        return str(awaited_attempt(endpoint, timeout_s))

    awaited = Walk(_endpoints(retries=2), "primary", LocalContext())
    awaited_answer = asyncio.run(awaited.run_on_loop(attempt))
    assert awaited_answer == blocking_answer
    assert awaited_tried == blocking_tried
    assert awaited.attempts == blocking.attempts == len(blocking_tried)
    assert awaited.served_by.model_id == blocking_answer


def test_a_request_refused_by_the_upstream_is_not_retried_on_the_loop() -> None:
    tried: list[str] = []

    async def attempt(endpoint: UpstreamEndpoint, timeout_s: float) -> str:
        tried.append(endpoint.model_id)
        raise AttemptFailure(Kind.REFUSED, "answered 400: bad request", 400)

    walk = Walk(_endpoints(), "primary", LocalContext())
    with pytest.raises(AttemptFailure) as refused:
        asyncio.run(walk.run_on_loop(attempt))
    assert refused.value.kind == Kind.REFUSED and tried == ["primary"]


def test_a_client_leaving_during_a_backoff_on_the_loop_ends_the_walk_at_once() -> None:
    context = LocalContext()
    tried: list[str] = []

    async def attempt(endpoint: UpstreamEndpoint, timeout_s: float) -> str:
        tried.append(endpoint.model_id)
        asyncio.get_running_loop().call_soon(context.cancel)  # the client goes during the wait
        raise AttemptFailure(Kind.OVERLOADED, "answered 429", 429, retry_after_s=30.0)

    async def walk_it() -> None:
        walk = Walk(_endpoints(max_retry_after_s=60.0), "primary", context)
        await asyncio.wait_for(walk.run_on_loop(attempt), 5.0)  # a 30 s backoff would outlast this

    with pytest.raises(Cancelled) as cancelled:
        asyncio.run(walk_it())
    assert cancelled.value.code == grpc.StatusCode.CANCELLED and tried == ["primary"]


def test_an_attempt_that_outlasts_its_timeout_on_the_loop_is_cancelled_and_counted_a_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attempts, "GRACE_S", 0.05)
    ended: list[str] = []

    async def hang() -> str:
        try:
            await asyncio.Event().wait()  # an upstream that never answers
        finally:
            ended.append("cancelled")
        return "never"

    async def walk_it() -> None:
        walk = Walk(_endpoints(timeout_s=0.05, retries=0), "primary", LocalContext())
        await walk.wait_on_loop(hang(), 0.05)

    with pytest.raises(AttemptFailure) as timed_out:
        asyncio.run(walk_it())
    assert timed_out.value.kind == Kind.TIMEOUT and ended == ["cancelled"]
