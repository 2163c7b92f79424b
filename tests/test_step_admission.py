"""Admission between the model's steps (`monolith.step_admission`), on a real collapsed stack.

The model is TinyLM behind a gate (`GatedModel`): while a long request holds it in a
step, the requests that arrive queue for the model's thread; opening the gate lets the
step end, and the model's thread decides them as one batch. The verdicts are the stages'
own, the same as a request decided in its own thread gets.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from spine.client.gateway_client import CallResult, GatewayClient
from spine.runtime.config import placements_for
from spine.runtime.faults import FaultHook
from spine.runtime.stack import Stack
from spine.v1 import generation_pb2
from tests.conftest import DEV_KEY, config_for_tests
from tests.test_serving_support import GatedModel, eventually, make_service

MODEL_THREAD = "inference-scheduler"


@dataclass
class ThreadRecorder:
    """A binding hook that notes which thread called which component (it never sleeps)."""

    calls: list[tuple[str, str]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def begin(self, component: str, method: str, metadata: list[tuple[str, str]]) -> Any:
        with self._lock:
            self.calls.append((component, threading.current_thread().name))

    def end(self, token: Any, code: grpc.StatusCode) -> None:
        return None

    def threads(self, component: str) -> list[str]:
        with self._lock:
            return [thread for name, thread in self.calls if name == component]


@dataclass
class Gated:
    stack: Stack
    model: GatedModel
    recorder: ThreadRecorder


@pytest.fixture()
def gated(tmp_path: Path) -> Iterator[Gated]:
    config = config_for_tests()
    service, model = make_service(max_batch=4)
    recorder = ThreadRecorder()
    stack = Stack(config, placements_for("collapsed", config), run_dir=tmp_path / "spine",
                  local_servicers={"inference": service}, hooks=[recorder])
    stack.start()
    try:
        yield Gated(stack, model, recorder)
    finally:
        model.open()
        stack.stop()


def request(prompt: str, max_tokens: int = 3) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(model="tiny-lm", prompt=prompt, max_tokens=max_tokens)


def in_threads(address: str, calls: list[tuple[generation_pb2.GenerateRequest, str]]) -> tuple[
        list[threading.Thread], dict[str, CallResult]]:
    """Each (request, key) sent from a thread of its own; results by prompt."""
    results: dict[str, CallResult] = {}

    def send(message: generation_pb2.GenerateRequest, key: str) -> None:
        with GatewayClient(address, key) as client:
            results[message.prompt] = client.generate(message, timeout=60)

    threads = [threading.Thread(target=send, args=call) for call in calls]
    for thread in threads:
        thread.start()
    return threads, results


def hold_the_model(gated: Gated) -> tuple[threading.Thread, dict[str, CallResult]]:
    """A long request inside a step that waits at the gate: the model is stepping."""
    gated.model.hold()
    threads, results = in_threads(gated.stack.address, [(request("the long one", max_tokens=12), DEV_KEY)])
    scheduler = gated.stack.step_admission.loop  # type: ignore[union-attr]
    eventually(lambda: scheduler.running_count == 1, what="the long request in a step")
    return threads[0], results


def test_requests_that_come_while_the_model_steps_are_decided_by_its_thread_in_one_batch(gated: Gated) -> None:
    stack = gated.stack
    step = stack.step_admission
    assert step is not None
    with GatewayClient(stack.address, DEV_KEY) as client:
        cached = client.generate(request("asked twice"))  # the model idle: decided in the caller's thread
        refused_idle = client.generate(request("no key either"), token="not-a-key")
    assert cached.ok and refused_idle.code == grpc.StatusCode.UNAUTHENTICATED
    assert step.stats.fallback == 2 and step.stats.batches == 0
    assert MODEL_THREAD not in gated.recorder.threads("auth")

    step.takeover_s = 30.0  # the gate holds the step as long as this test wants
    long_thread, long_result = hold_the_model(gated)
    calls = [(request(f"new {index}"), DEV_KEY) for index in range(3)]
    calls += [(request("asked twice"), DEV_KEY), (request("no key"), "not-a-key")]
    threads, results = in_threads(stack.address, calls)
    eventually(lambda: step.queued == len(calls), what="every request queued for the model's thread")
    gated.model.open()
    for thread in [*threads, long_thread]:
        thread.join(60)

    assert step.stats.batches == 1 and step.stats.items == len(calls) and step.stats.taken_back == 0
    assert gated.recorder.threads("auth").count(MODEL_THREAD) == len(calls)
    assert all(results[f"new {index}"].ok for index in range(3)) and long_result["the long one"].ok
    hit = results["asked twice"]
    assert hit.ok and hit.response is not None and hit.response.cached
    assert hit.response.token_ids == cached.token_ids
    refused = results["no key"]
    assert (refused.code, refused.details) == (refused_idle.code, refused_idle.details)


def test_a_step_that_does_not_end_holds_no_answer_the_model_is_not_needed_for(gated: Gated) -> None:
    stack = gated.stack
    step = stack.step_admission
    assert step is not None
    with GatewayClient(stack.address, DEV_KEY) as client:
        assert client.generate(request("asked again")).ok
    step.takeover_s = 0.2
    long_thread, long_result = hold_the_model(gated)
    with GatewayClient(stack.address, DEV_KEY) as client:
        hit = client.generate(request("asked again"), timeout=10)
        refused = client.generate(request("who am I"), token="not-a-key", timeout=10)
    assert hit.ok and hit.response is not None and hit.response.cached
    assert refused.code == grpc.StatusCode.UNAUTHENTICATED
    assert step.stats.taken_back == 2 and step.stats.batches == 0
    assert not long_thread.join(0.05) and long_thread.is_alive()  # the step is still held
    gated.model.open()
    long_thread.join(60)
    assert long_result["the long one"].ok


def test_closing_hands_queued_requests_back_to_their_own_threads(gated: Gated) -> None:
    stack = gated.stack
    step = stack.step_admission
    assert step is not None
    step.takeover_s = 30.0
    long_thread, long_result = hold_the_model(gated)
    threads, results = in_threads(stack.address, [(request("queued at close"), DEV_KEY)])
    eventually(lambda: step.queued == 1, what="the request queued for the model's thread")
    scheduler = step.loop
    step.close()  # the micro-batcher is still open: it admits the request, which then waits for the model
    eventually(lambda: scheduler.queue_depth + scheduler.running_count == 2,
               what="the request handed back, admitted and at the model")
    gated.model.open()
    for thread in [*threads, long_thread]:
        thread.join(60)
    assert results["queued at close"].ok and long_result["the long one"].ok
    assert step.stats.batches == 0 and step.stats.fallback == 2  # the long one (model idle) and this one


def test_only_where_deciding_can_never_hold_the_model_up(tmp_path: Path) -> None:
    config = config_for_tests()
    for name, hooks, overrides in (("faults", [FaultHook(component="auth")], {}),
                                   ("off", [], {"batching": {"between_steps": False}}),
                                   ("unbatched", [], {"batching": {"enabled": False}})):
        merged = config_for_tests(**overrides)
        stack = Stack(merged, placements_for("collapsed", merged), run_dir=tmp_path / name, hooks=hooks)
        stack.start()
        try:
            assert stack.step_admission is None, name
            assert stack.gateway is not None and stack.gateway.admission is not None
            with GatewayClient(stack.address, DEV_KEY) as client:
                assert client.generate(request(f"served {name}")).ok
        finally:
            stack.stop()
    stack = Stack(config, placements_for("mixed", config), run_dir=tmp_path / "mixed")  # auth in its own process
    stack.start()
    try:
        assert stack.step_admission is None
    finally:
        stack.stop()
