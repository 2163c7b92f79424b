"""The load-aware client helper: backoff with jitter, fallback with hysteresis, `spine call`.

The server is a real gRPC server speaking the Gateway API whose answers follow a script
(overloaded or not, with which load hints), so each behaviour is shown call by call.
"""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from runtime.server import start_server
from services.common import ConfigError
from services.registry import GATEWAY
from services.router.config import RouterConfig
from spine.cli import main
from spine.client.gateway_client import GatewayClient
from spine.client.overload_client import Backoff, Fallback, LoadAwareClient, router_models
from wire.v1 import gateway_pb2_grpc, generation_pb2

BUSY = "queue=9;running=4;slots=4;kv_free=0;mem_free_mb=100.0;ms_per_token=1.000;busy=0.990"
CALM = "queue=0;running=1;slots=4;kv_free=3;mem_free_mb=100.0;ms_per_token=1.000;busy=0.300"
# Busy decoding, but nothing waits: timeouts here are the client's deadline, not overload.
WARM = "queue=0;running=2;slots=4;kv_free=2;mem_free_mb=100.0;ms_per_token=1.000;busy=0.600"
SMALL = "queue=0;running=0;slots=8;kv_free=8;mem_free_mb=100.0;ms_per_token=0.200;busy=0.100"
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
TIMEOUT = grpc.StatusCode.DEADLINE_EXCEEDED


class ScriptedGateway(gateway_pb2_grpc.GatewayServicer):
    """Answers each call with the next (status, load of "big") of its script; records the models
    asked. As the spine's gateway does, "big" names its fallback "small", and "small"'s answers
    carry "big"'s load (`without_primary_load`: they do not)."""

    def __init__(self) -> None:
        self.script: list[tuple[grpc.StatusCode | None, str]] = []
        self.models: list[str] = []
        self.known = {"big", "small"}
        self.without_primary_load = False
        self._lock = threading.Lock()

    def Generate(self, request: generation_pb2.GenerateRequest, context: Any) -> generation_pb2.GenerateResponse:
        with self._lock:
            self.models.append(request.model)
            code, load = self.script.pop(0) if self.script else (None, CALM)
        if request.model == "small":
            trailing = [("x-spine-load", SMALL)]
            if not self.without_primary_load:
                trailing.append(("x-spine-primary-load", f"big:{load}"))
        else:
            trailing = [("x-spine-load", load), ("x-spine-fallback", "small")]
        context.set_trailing_metadata(tuple(trailing))
        if request.model not in self.known:
            context.abort(grpc.StatusCode.NOT_FOUND, f"model {request.model!r} not found")
        if code is not None:
            context.abort(code, "inference is at capacity")
        return generation_pb2.GenerateResponse(text="ok", token_ids=[1, 2], model=request.model)

    def GenerateStream(self, request: generation_pb2.GenerateRequest, context: Any) -> Iterator[Any]:
        response = self.Generate(request, context)
        yield generation_pb2.GenerateChunk(text=response.text, token_ids=response.token_ids, model=response.model)


@pytest.fixture(scope="module")
def gateway() -> Iterator[tuple[ScriptedGateway, str]]:
    servicer = ScriptedGateway()
    server = start_server([(GATEWAY, servicer)], "127.0.0.1:0")
    yield servicer, server.address
    server.stop(grace=0.2)


@pytest.fixture
def scripted(gateway: tuple[ScriptedGateway, str]) -> Iterator[tuple[ScriptedGateway, GatewayClient]]:
    servicer, address = gateway
    servicer.script.clear()
    servicer.models.clear()
    servicer.without_primary_load = False
    with GatewayClient(address) as client:
        yield servicer, client


def _request(model: str = "big") -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(model=model, prompt="hi", max_tokens=2)


def test_overload_is_retried_with_exponential_backoff_and_jitter(scripted: tuple) -> None:
    servicer, client = scripted
    servicer.script = [(EXHAUSTED, BUSY)] * 3
    waits: list[float] = []
    helper = LoadAwareClient(client, Backoff(attempts=5, base_s=0.1, factor=2, max_s=0.3),
                             sleep=waits.append, rng=random.Random(7))
    result = helper.generate(_request())
    assert result.ok and result.attempts == 4 and len(waits) == 3
    for retry, wait in enumerate(waits):  # full jitter under a ceiling that doubles, capped
        assert 0 <= wait <= min(0.3, 0.1 * 2**retry)
    assert len(set(waits)) == 3  # jittered, not in lock step
    assert result.load["kv_free"] == 3


def test_the_helper_gives_up_after_its_attempts_with_the_last_overload_answer(scripted: tuple) -> None:
    servicer, client = scripted
    servicer.script = [(EXHAUSTED, BUSY)] * 5
    result = LoadAwareClient(client, Backoff(attempts=3), sleep=lambda _: None).generate(_request())
    assert result.code == EXHAUSTED and result.attempts == 3 and len(servicer.models) == 3


def test_errors_that_are_not_overload_are_not_retried(scripted: tuple) -> None:
    servicer, client = scripted
    servicer.script = [(grpc.StatusCode.INVALID_ARGUMENT, CALM)]
    result = LoadAwareClient(client, sleep=lambda _: pytest.fail("slept")).generate(_request())
    assert result.code == grpc.StatusCode.INVALID_ARGUMENT and result.attempts == 1


def test_a_retry_after_trailer_is_the_least_the_helper_waits() -> None:
    assert Backoff(base_s=0.01).delay(0, random.Random(1), retry_after_s=1.5) == 1.5


def test_fallback_after_n_overloads_and_return_only_after_m_calm_answers(scripted: tuple) -> None:
    servicer, client = scripted
    helper = LoadAwareClient(client, Backoff(attempts=1), Fallback("small", after=2, recover_after=3),
                             sleep=lambda _: None)
    servicer.script = [(EXHAUSTED, BUSY), (EXHAUSTED, BUSY)]
    helper.generate(_request())
    assert not helper.using_fallback  # one overload is not enough
    helper.generate(_request())
    assert helper.using_fallback
    servicer.script = [(None, CALM), (None, CALM), (None, BUSY), (None, CALM), (None, CALM), (None, CALM)]
    for _ in range(6):
        result = helper.generate(_request())
    # calm, calm, busy (streak reset), calm ×3 → back: the last call went to "small", the next to "big"
    assert servicer.models[2:] == ["small"] * 6 and result.model == "small"
    assert not helper.using_fallback
    assert helper.generate(_request()).model == "big"


def test_three_timeouts_in_a_row_while_the_model_is_over_95_percent_busy_fall_back(scripted: tuple) -> None:
    """The fallback policy: both signals together, then the cheaper model the server names."""
    servicer, client = scripted
    helper = LoadAwareClient(client, Backoff(attempts=1), Fallback(), sleep=lambda _: None)
    servicer.script = [(TIMEOUT, BUSY), (TIMEOUT, BUSY), (None, BUSY), (TIMEOUT, BUSY), (TIMEOUT, BUSY)]
    for _ in range(5):  # two timeouts, an answer (the streak starts over), two timeouts
        helper.generate(_request())
    assert not helper.using_fallback
    servicer.script = [(TIMEOUT, BUSY), (None, BUSY)]
    helper.generate(_request())
    assert helper.using_fallback and helper.fallback_model == "small"  # learnt from x-spine-fallback
    assert "3 timeouts in a row, the model 99% busy" in helper.why
    assert helper.generate(_request()).model == "small"


def test_timeouts_while_the_model_is_not_that_busy_do_not_fall_back(scripted: tuple) -> None:
    servicer, client = scripted
    helper = LoadAwareClient(client, Backoff(attempts=1), Fallback(), sleep=lambda _: None)
    servicer.script = [(TIMEOUT, WARM)] * 5
    for _ in range(5):
        helper.generate(_request())
    assert not helper.using_fallback and servicer.models == ["big"] * 5


def test_a_fallback_answer_without_the_requested_models_load_is_not_calm(scripted: tuple) -> None:
    servicer, client = scripted
    now = [0.0]
    helper = LoadAwareClient(client, Backoff(attempts=1), Fallback(after=1, recover_after=2, blind_s=30),
                             sleep=lambda _: None, clock=lambda: now[0])
    servicer.script = [(EXHAUSTED, BUSY)]
    helper.generate(_request())
    assert helper.using_fallback
    servicer.without_primary_load = True
    for _ in range(5):  # the fallback itself is calm, but that says nothing of "big"
        helper.generate(_request())
    assert helper.using_fallback and helper.calm_streak == 0
    now[0] = 31.0  # no word of "big" for longer than blind_s: try it again
    helper.generate(_request())
    assert not helper.using_fallback and helper.generate(_request()).model == "big"


def test_an_overloaded_attempt_can_switch_to_the_fallback_within_one_request(scripted: tuple) -> None:
    servicer, client = scripted
    servicer.script = [(EXHAUSTED, BUSY), (EXHAUSTED, BUSY)]
    helper = LoadAwareClient(client, Backoff(attempts=3), Fallback("small", after=2), sleep=lambda _: None)
    result = helper.generate(_request())
    assert result.ok and result.attempts == 3 and servicer.models == ["big", "big", "small"]


def test_a_fallback_alias_the_router_does_not_know_is_refused_at_config_load() -> None:
    router = RouterConfig.parse({"models": [{"id": "tiny-lm", "backend": "inference", "aliases": ["default", "tiny"]}]})
    assert router_models(router) == ["tiny-lm", "default", "tiny"]
    Fallback("tiny").validate(router_models(router))
    with pytest.raises(ConfigError, match="'nano' is not a model or alias the router knows"):
        Fallback("nano").validate(router_models(router))


def test_a_fallback_alias_missing_on_the_server_is_a_clear_error_at_request_time(scripted: tuple) -> None:
    servicer, client = scripted
    servicer.script = [(EXHAUSTED, BUSY)]
    helper = LoadAwareClient(client, Backoff(attempts=2), Fallback("nano", after=1), sleep=lambda _: None)
    result = helper.generate(_request())
    assert result.code == grpc.StatusCode.NOT_FOUND and "fallback model 'nano' does not exist" in result.details


def test_a_stream_is_retried_on_overload_before_its_first_chunk(scripted: tuple) -> None:
    servicer, client = scripted
    servicer.script = [(EXHAUSTED, BUSY)]
    result = LoadAwareClient(client, sleep=lambda _: None).stream(_request())
    assert result.ok and result.attempts == 2 and result.text == "ok"


def test_spine_call_retries_overload_through_the_helper(gateway: tuple, capsys: pytest.CaptureFixture[str]) -> None:
    servicer, address = gateway
    servicer.script = [(EXHAUSTED, BUSY)]
    code = main(["call", "--address", address, "--model", "big", "--json", "--backoff-s", "0.001",
                 "--token", "t"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["attempts"] == 2 and out["load"]["kv_free"] == 3


def test_spine_call_fallback_shows_the_switch_and_the_way_back(gateway: tuple,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    servicer, address = gateway
    servicer.script = [(EXHAUSTED, BUSY)] * 3 + [(None, CALM)] * 5
    servicer.models.clear()
    code = main(["call", "--address", address, "--model", "big", "--json", "--retries", "0", "--token", "t",
                 "--fallback", "--count", "9", "--fallback-recover", "5"])
    calls = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 0 and [c["call"] for c in calls] == list(range(1, 10))
    assert [c["model"] for c in calls] == ["big"] * 3 + ["small"] * 5 + ["big"]
    assert [c["fallback"]["active"] for c in calls] == [False, False, True, True, True, True, True, False, False]
    assert calls[2]["fallback"] == {"active": True, "model": "small", "why": "3 overload answers in a row"}


def test_spine_call_refuses_an_unknown_fallback_alias(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["call", "--fallback-model", "nano", "--address", "127.0.0.1:1"]) == 2
    assert "fallback.model: 'nano'" in capsys.readouterr().err
