"""Per-request warnings under a flood: each event one DEBUG line, at WARNING (or ERROR) at most
one line a second per key, whose counts add up to every event (`services.common.log_limit`).

Each warning a flood of requests can repeat is flooded here through the code that writes it:
shadow mismatches and failed shadow calls, fail-open middlewares that failed, a broken
pipeline step, HTTP requests a broken gateway fails, decode steps of a broken model, and
overloaded answers with no fallback known. (An
undecodable body, an output-policy violation and a refused dashboard token are flooded where
their servers already run: test_layouts, test_answer_policies_layouts, test_migration_dashboard.)
"""

from __future__ import annotations

import http.client
import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from runtime.config.sections import ShadowConfig
from runtime.shadow.decisions import Decision
from runtime.shadow.metrics import MISMATCHED
from runtime.shadow.traffic import ShadowMirror
from services.common.log_limit import RateLimitedLog
from tests.log_lines import LogLines, assert_summarized
from tests.waiting import ShiftedClock, eventually
from wire.v1 import generation_pb2

GREEDY = generation_pb2.GenerateRequest(model="tiny-lm", prompt="flood", max_tokens=3)


def _answer(tokens: tuple[int, ...]) -> Decision:
    return Decision("OK", "", "passed", "passed", "tiny-lm", False, tokens)


def test_the_limiter_writes_a_busy_seconds_summary_by_itself_once_the_second_is_up() -> None:
    log = logging.getLogger("spine.test.limiter")
    clock = ShiftedClock()
    limiter = RateLimitedLog(log, "test events", every_s=0.2, clock=clock)
    with LogLines(log.name) as lines:
        for number in range(50):
            limiter("k", "event %d", number)
        assert lines.at(logging.WARNING) == ["event 0"]  # the first at once, the rest counted
        eventually(lambda: len(lines.at(logging.WARNING)) >= 2, what="the summary written by the limiter's timer")
        assert lines.at(logging.WARNING) == ["event 0", "49 test events in the last 0.2s, first: event 1"]
        clock.advance(0.25)  # a quiet key's next event is written at once again
        limiter("k", "event %d", 50)
        limiter("other key", "event %d", 51)  # another key is never held back by this one
        assert lines.at(logging.WARNING)[2:] == ["event 50", "event 51"]
    assert len(lines.at(logging.DEBUG)) == 52


def test_shadow_mismatches_flooded_are_summarized_per_layout_pair_and_all_counted() -> None:
    mirror = ShadowMirror(ShadowConfig(share=1.0, ignore_fields=()), lambda *a: _answer(()), key=b"k" * 16)
    with LogLines("spine.shadow") as lines:
        for number in range(150):
            mirror.compare("layered", "spine", _answer((1, 2, 3)), _answer((1, 2, 9)), request_id=f"a{number}")
            mirror.compare("spine", "layered", _answer((7,)), _answer((7, 8)), request_id=f"b{number}")
        loud = assert_summarized(lines, mirror._mismatch_log, 300, keys=2, containing="shadow mismatch")
    assert any("tokens differ at position 2 (layered 3 tokens, spine 3)" in line for line in loud)
    assert mirror.counters.value(MISMATCHED, field="tokens") == 300  # /metrics counts every one
    debug = lines.at(logging.DEBUG)
    assert "request a0, layered said {tokens=(1, 2, 3)}; spine said {tokens=(1, 2, 9)}" in debug[0]
    mirror.close()


def test_failed_shadow_calls_flooded_are_summarized() -> None:
    def refused(*args: Any) -> Decision:
        raise ConnectionError("the other side is gone")

    mirror = ShadowMirror(ShadowConfig(share=1.0, max_in_flight=64, calibration_share=0.0), refused, key=b"k" * 16)
    with LogLines("spine.shadow") as lines:
        for _ in range(100):
            mirror.offer("layered", GREEDY, (), _answer((1,)))
        assert mirror.wait_idle()
        failed = mirror.stats()["counts"]["errors"]
        assert failed >= 50  # the rest found the pool full (dropped, counted as saturated)
        assert_summarized(lines, mirror._failure_log, failed, containing="shadow call to spine failed")
    mirror.close()


def test_a_fail_open_middleware_failing_every_request_is_summarized_per_component() -> None:
    from services.pipeline import pipeline
    from services.pipeline.pipeline import FailOpenCount

    counted = FailOpenCount()
    with LogLines("spine.pipeline", pipeline._fail_open) as lines, ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda n: counted("logs" if n % 2 else "metrics", "UNAVAILABLE: down", f"r{n}"), range(400)))
        assert_summarized(lines, pipeline._fail_open, 400, keys=2, containing="fail-open")
    assert counted.by_component == {"logs": 200, "metrics": 200}


def test_a_broken_stage_failing_every_batch_is_summarized() -> None:
    from services.pipeline import pipeline
    from services.pipeline.limits import RequestLimits
    from services.pipeline.pipeline import Pipeline
    from services.pipeline.state import RequestState
    from services.pipeline.step import FailMode, Step, StepPolicy

    class BrokenStep(Step):
        method = "Check"

        def decide(self, batch: list[RequestState], call: Any) -> None:
            raise RuntimeError("a handler's bug")

    from services.registry import DEFAULT

    step = BrokenStep(StepPolicy("auth", FailMode.CLOSED), RequestLimits())
    runner = Pipeline(DEFAULT.steps(RequestLimits()), {})
    states = [RequestState(request=GREEDY, request_id=f"r{n}", layout="collapsed", started=0.0,
                           deadline=time.monotonic() + 60, shadow=False, metadata=(), model="tiny-lm") for n in range(200)]
    with LogLines("spine.pipeline", pipeline._step_failures) as lines:
        for state in states:
            runner.run(step, [state])
        assert_summarized(lines, pipeline._step_failures, 200, containing="step auth.check failed")
    assert all(state.outcome is not None for state in states)  # each request stopped (the step fails closed)


class _BrokenGateway:
    """A gateway with a bug: every call raises (what the HTTP front turns into a 500)."""

    def Generate(self, request: Any, context: Any) -> Any:
        raise RuntimeError("a gateway bug")

    def GenerateStream(self, request: Any, context: Any) -> Iterator[Any]:
        raise RuntimeError("a gateway bug")


@pytest.fixture(scope="module")
def broken_http() -> Iterator[str]:
    from runtime.http.server import start_http
    from tests.conftest import config_for_tests

    config = config_for_tests()
    server, app = start_http(_BrokenGateway(), config.http, config.router, config.limits, 8, "127.0.0.1:0",
                             layout=lambda: "collapsed", serving=lambda: True)
    yield server.address
    server.stop(2.0)
    app.close()


def test_http_requests_a_broken_gateway_fails_are_summarized(broken_http: str) -> None:
    from runtime.http import verdicts
    from tests.conftest import DEV_KEY

    host, port = broken_http.rsplit(":", 1)
    body = '{"model": "tiny-lm", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}'

    def post(_: int) -> int:
        connection = http.client.HTTPConnection(host, int(port), timeout=10)
        connection.request("POST", "/v1/chat/completions", body, {"authorization": f"Bearer {DEV_KEY}",
                                                                   "content-type": "application/json"})
        status = connection.getresponse().status
        connection.close()
        return status

    with LogLines("spine.http", verdicts._gateway_failures) as lines, ThreadPoolExecutor(8) as pool:
        assert set(pool.map(post, range(60))) == {500}
        assert_summarized(lines, verdicts._gateway_failures, 60, containing="the gateway failed")
    assert lines.records[0].exc_info is not None  # the first with its traceback


def test_decode_steps_of_a_broken_model_are_summarized() -> None:
    from services.inference import scheduler
    from tests.unit.test_serving_support import Call, make_service, request

    service, model = make_service()
    try:
        model.broken = True
        with LogLines("spine.inference", scheduler._step_failures) as lines:
            calls = [Call(service, request(f"p{n}")) for n in range(40)]
            for call in calls:
                assert call.wait().error is not None
            failed = len(lines.at(logging.DEBUG, "decode step failed"))
            assert failed >= 1
            assert_summarized(lines, scheduler._step_failures, failed, containing="decode step failed")
    finally:
        service.close()


class _Overloaded:
    """A gateway at capacity that names no fallback model."""

    def Generate(self, request: Any, context: Any) -> Any:
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "inference is at capacity")

    def GenerateStream(self, request: Any, context: Any) -> Iterator[Any]:
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "inference is at capacity")
        yield from ()


def test_overloaded_answers_with_no_fallback_known_are_summarized() -> None:
    from runtime.server import start_server
    from services.registry import GATEWAY
    from spine.client import overload_client
    from spine.client.gateway_client import GatewayClient
    from spine.client.overload_client import Backoff, Fallback, LoadAwareClient

    running = start_server([(GATEWAY, _Overloaded())], "127.0.0.1:0")
    try:
        with GatewayClient(running.address) as client, LogLines("spine.load_hints", overload_client._no_fallback) as lines:
            helper = LoadAwareClient(client, Backoff(attempts=1), Fallback(after=1))
            for _ in range(50):
                assert helper.generate(GREEDY).code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert_summarized(lines, overload_client._no_fallback, 50, containing="no fallback is known")
    finally:
        running.stop(0.5)
