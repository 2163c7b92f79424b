"""Deep health: SERVING only while the model can run a tiny forward in time; the supervisor follows."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from runtime.health.deep import start_deep_health
from runtime.processes.supervisor import Child, Supervisor
from runtime.server import RunningServer, start_server
from services.registry import DEFAULT
from tests.unit.test_serving_support import GatedModel, make_service
from tests.waiting import eventually

INFERENCE = "spine.v1.Inference"


@pytest.fixture
def served() -> Iterator[tuple[RunningServer, object, GatedModel]]:
    service, model = make_service()
    server = start_server([(DEFAULT["inference"], service)], "127.0.0.1:0")
    try:
        yield server, service, model
    finally:
        model.open()
        server.stop(grace=0.5)
        service.close()


def _status(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return int(reply.status)


SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def test_a_process_turns_not_serving_when_its_model_cannot_run_and_back_when_it_can(served: tuple) -> None:
    server, service, model = served
    deep = start_deep_health(server, service, interval_s=0.02, timeout_s=5.0, services=["", INFERENCE])
    try:
        assert deep.serving and _status(server.address) == SERVING
        model.broken = True  # the device fails: every forward raises
        eventually(lambda: _status(server.address) == NOT_SERVING, what="NOT_SERVING")
        assert _status(server.address, INFERENCE) == NOT_SERVING
        assert "device lost" in deep.reason
        model.broken = False
        eventually(lambda: _status(server.address) == SERVING, what="SERVING again")
    finally:
        deep.stop()


def test_a_forward_that_does_not_finish_within_the_bound_is_not_serving(served: tuple) -> None:
    server, service, model = served
    model.hold()  # the forward hangs, as on a wedged device
    deep = start_deep_health(server, service, interval_s=0.02, timeout_s=0.1)
    try:
        assert not deep.serving and "within 0.1s" in deep.reason
        assert _status(server.address) == NOT_SERVING
        model.open()
        eventually(lambda: _status(server.address) == SERVING, what="SERVING once the forward returns")
    finally:
        deep.stop()


def test_a_model_that_never_runs_never_reports_serving(served: tuple) -> None:
    server, service, model = served
    model.broken = True
    deep = start_deep_health(server, service, interval_s=0.02, timeout_s=5.0)
    try:
        assert not deep.serving
        assert _status(server.address) == NOT_SERVING  # start_server's liveness SERVING was overridden
    finally:
        deep.stop()


def test_the_supervisor_tracks_readiness_by_deep_health_while_a_child_runs(served: tuple,
                                                                         tmp_path: Path) -> None:
    server, service, model = served
    deep = start_deep_health(server, service, interval_s=0.02, timeout_s=5.0)
    supervisor = Supervisor(tmp_path)
    supervisor.children["inference"] = Child("inference", [], server.address, tmp_path / "inference.log")
    try:
        assert supervisor.refresh_health() == {"inference": True}
        model.broken = True
        eventually(lambda: supervisor.refresh_health() == {"inference": False}, what="not ready")
        model.broken = False
        eventually(lambda: supervisor.refresh_health() == {"inference": True}, what="ready again")
    finally:
        deep.stop()
        supervisor.stop(grace=0.1)
