"""Outlier ejection: a component that keeps failing is skipped fast, then probed back in."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from runtime.running_stack import RunningStack
from services.common.outlier import Ejected, Ejection, OutlierDetector, OutlierPolicy
from spine.client.gateway_client import GatewayClient
from tests.conftest import DEV_KEY, config_for_tests, start_stack, stop_process
from tests.waiting import eventually
from wire.v1 import generation_pb2

CODE = grpc.StatusCode


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def detector(failures: int = 3) -> tuple[OutlierDetector, Clock]:
    clock = Clock()
    return OutlierDetector("auth", OutlierPolicy(failures, 1.0, 4.0), budget_s=0.25, clock=clock), clock


def test_consecutive_failures_eject_and_calls_then_fail_fast() -> None:
    outlier, _ = detector(failures=3)
    for _ in range(2):
        outlier.admit()
        outlier.record(CODE.UNAVAILABLE, 0.25)
    assert outlier.state == Ejection.IN
    outlier.admit()
    outlier.record(CODE.DEADLINE_EXCEEDED, 0.25)  # a call that had the whole budget: the component's fault
    assert outlier.state == Ejection.OUT and outlier.ejections == 1
    with pytest.raises(Ejected, match="auth ejected after 3 consecutive failures"):
        outlier.admit()


def test_an_answer_resets_the_count_and_verdicts_are_answers() -> None:
    outlier, _ = detector(failures=2)
    outlier.record(CODE.UNAVAILABLE, 0.25)
    outlier.record(CODE.UNAUTHENTICATED, 0.25)  # the component's own verdict: it is alive
    outlier.record(CODE.UNAVAILABLE, 0.25)
    assert outlier.state == Ejection.IN


def test_a_client_deadline_shorter_than_the_budget_never_ejects() -> None:
    """A client sending tiny deadlines must not be able to eject a healthy component."""
    outlier, _ = detector(failures=2)
    for _ in range(10):
        outlier.record(CODE.DEADLINE_EXCEEDED, 0.01)
    assert outlier.state == Ejection.IN and outlier.ejections == 0


def test_after_the_cooldown_one_probe_goes_out_and_its_answer_decides() -> None:
    outlier, clock = detector(failures=1)
    outlier.record(CODE.UNAVAILABLE, 0.25)
    clock.now += 1.0
    outlier.admit()  # the probe
    assert outlier.state == Ejection.PROBING
    with pytest.raises(Ejected, match="a probe is in flight"):
        outlier.admit()
    outlier.record(CODE.UNAVAILABLE, 0.25)  # the probe failed: out again, for twice as long
    assert outlier.state == Ejection.OUT
    clock.now += 1.5
    with pytest.raises(Ejected, match="next probe in 0.5s"):
        outlier.admit()
    clock.now += 0.5
    outlier.admit()
    outlier.record(CODE.OK, 0.25)  # the probe answered: back in
    assert outlier.state == Ejection.IN
    outlier.admit()


def test_the_cooldown_doubles_up_to_the_cap() -> None:
    outlier, clock = detector(failures=1)
    outlier.record(CODE.UNAVAILABLE, 0.25)
    waits = []
    for _ in range(4):
        start = clock.now
        while True:
            try:
                outlier.admit()
                break
            except Ejected:
                clock.now += 0.5
        waits.append(clock.now - start)
        outlier.record(CODE.UNAVAILABLE, 0.25)
    assert waits == [1.0, 2.0, 4.0, 4.0]


@pytest.fixture
def layered(tmp_path: Path) -> Iterator[RunningStack]:
    config = config_for_tests(calls={"eject_after_failures": 2, "ejection_ms": 500})
    stack = start_stack("layered", tmp_path, config)
    try:
        yield stack
    finally:
        stack.stop()


def request(prompt: str) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(model="tiny-lm", prompt=prompt, max_tokens=2)


def test_a_hung_auth_answers_unavailable_within_its_budget_then_at_once_then_comes_back(layered: RunningStack) -> None:
    assert layered.supervisor is not None
    pid = layered.supervisor.children["auth"].pid
    assert pid is not None
    with GatewayClient(layered.address, DEV_KEY) as client:
        assert client.generate(request("before")).ok
        stop_process(pid)
        try:
            timed = [client.generate(request(f"hung {i}"), timeout=5.0) for i in range(2)]
            assert all(r.code == CODE.UNAVAILABLE and "budget" in r.details for r in timed), timed
            assert all(r.latency_s < 1.0 for r in timed)  # 250 ms budget, not the 5 s deadline
            fast = client.generate(request("ejected"), timeout=5.0)
            assert fast.code == CODE.UNAVAILABLE and "ejected" in fast.details
            assert fast.latency_s < 0.2
        finally:
            os.kill(pid, signal.SIGCONT)
        eventually(lambda: client.generate(request("back")).ok, 10, "auth readmitted", interval=0.1)
    layered.drain()
    address = layered.metrics_address()
    assert address is not None
    import urllib.request

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    ejected = [s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "spine_middleware_ejected_total" and s.labels == {"middleware": "auth"}]
    assert ejected and ejected[0] >= 1


def test_the_health_watcher_fails_calls_fast_while_down_and_readmits_when_serving() -> None:
    outlier, _ = detector(failures=1)
    outlier.record(CODE.UNAVAILABLE, 0.25)  # ejected by its failures
    outlier.set_health(False, "no health answer within 0.5s, twice")
    with pytest.raises(Ejected, match=r"auth is not serving \(no health answer within 0.5s, twice\)"):
        outlier.admit()
    outlier.set_health(True, "SERVING")
    outlier.admit()  # its health answered: back in without waiting for a probe
    assert outlier.state == Ejection.IN
