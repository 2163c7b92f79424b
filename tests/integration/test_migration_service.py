"""MigrationControl over real gRPC: the admin token, status codes, events, health, reflection."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from migration.recording import RecordingTarget
from migration.server import ControllerProcess, check_listen
from migration.testing import ADMIN_TOKEN, HEALTHY, THREE_STAGES
from services.common import ConfigError
from wire.v1 import migration_pb2 as pb
from wire.v1 import migration_pb2_grpc as pb_grpc

AUTH = (("authorization", f"Bearer {ADMIN_TOKEN}"),)


@pytest.fixture
def served(tmp_path) -> Iterator[tuple[ControllerProcess, grpc.Channel, RecordingTarget]]:
    sockets = tempfile.mkdtemp(prefix="mig", dir="/tmp")  # short: unix socket paths are capped at 107
    target = RecordingTarget(layered=HEALTHY, spine=HEALTHY)
    process = ControllerProcess(str(tmp_path / "m.db"), f"unix:{sockets}/c.sock", ADMIN_TOKEN, target, tick_s=0.05)
    process.start()
    channel = grpc.insecure_channel(process.listen)
    try:
        yield process, channel, target
    finally:
        channel.close()
        process.stop(grace=0.2)
        shutil.rmtree(sockets, ignore_errors=True)


def stub(channel: grpc.Channel) -> pb_grpc.MigrationControlStub:
    return pb_grpc.MigrationControlStub(channel)


@pytest.mark.parametrize("metadata, detail", [
    ((), "missing admin token"),
    ((("authorization", "Bearer wrong-token-0123456789"),), "not accepted"),
    ((("authorization", f"Basic {ADMIN_TOKEN}"),), "missing admin token"),
])
def test_calls_without_the_right_admin_token_are_unauthenticated(served, metadata, detail):
    _, channel, target = served
    for call in (lambda: stub(channel).Status(pb.StatusRequest(), metadata=metadata, timeout=5),
                 lambda: stub(channel).Start(pb.StartRequest(plan_yaml=THREE_STAGES), metadata=metadata, timeout=5)):
        with pytest.raises(grpc.RpcError) as caught:
            call()
        assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert detail in caught.value.details() and ADMIN_TOKEN not in caught.value.details()
    assert target.applies == []


def test_the_right_token_starts_a_rollout_and_status_reports_it(served):
    _, channel, target = served
    started = stub(channel).Start(pb.StartRequest(plan_yaml=THREE_STAGES, actor="carol", reason="go"),
                                  metadata=AUTH, timeout=5)
    assert (started.state, started.stage_name, started.stage_count, started.spine_weight) == (
        "progressing", "logs", 3, 10.0)
    assert started.layered_weight == 90 and started.placements["logs"] == "local"
    status = stub(channel).Status(pb.StatusRequest(), metadata=AUTH, timeout=5)
    assert status.recent_audit[0].actor == "carol" and status.recent_audit[0].reason == "go"
    assert list(status.stage_names) == ["logs", "cache", "all"]
    assert target.applies[0].spine_weight == 10


def test_a_command_that_makes_no_sense_is_failed_precondition(served):
    _, channel, _ = served
    with pytest.raises(grpc.RpcError) as caught:
        stub(channel).Approve(pb.ApproveRequest(), metadata=AUTH, timeout=5)
    assert caught.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "nothing awaits approval" in caught.value.details()


def test_a_bad_plan_is_invalid_argument_naming_field_and_line(served):
    _, channel, _ = served
    bad = THREE_STAGES.replace("spine_weight: 50", "spine_weight: 500")
    for call in (lambda: stub(channel).Plan(pb.PlanRequest(plan_yaml=bad, validate_only=True), metadata=AUTH),
                 lambda: stub(channel).Start(pb.StartRequest(plan_yaml=bad), metadata=AUTH)):
        with pytest.raises(grpc.RpcError) as caught:
            call()
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "stages[1].spine_weight (line 14): must be between 0 and 100, got 500" in caught.value.details()


def test_plan_validates_or_loads_without_applying_anything(served):
    _, channel, target = served
    checked = stub(channel).Plan(pb.PlanRequest(plan_yaml=THREE_STAGES, validate_only=True), metadata=AUTH)
    assert not checked.loaded and [s.name for s in checked.stages] == ["logs", "cache", "all"]
    assert stub(channel).Status(pb.StatusRequest(), metadata=AUTH).plan_name == ""
    loaded = stub(channel).Plan(pb.PlanRequest(plan_yaml=THREE_STAGES), metadata=AUTH)
    assert loaded.loaded and loaded.stages[2].manual_approval and loaded.stages[0].hold_s == 2
    status = stub(channel).Start(pb.StartRequest(), metadata=AUTH)
    assert status.plan_name == "three" and status.state == "progressing" and len(target.applies) == 1


def test_watch_events_starts_with_the_status_then_streams_each_transition(served):
    _, channel, _ = served
    control = stub(channel)
    control.Start(pb.StartRequest(plan_yaml=THREE_STAGES, actor="dave"), metadata=AUTH)
    stream = control.WatchEvents(pb.WatchRequest(), metadata=AUTH, timeout=20)
    first = next(stream)
    assert not first.HasField("audit") and first.status.state == "progressing"
    control.Pause(pb.CommandRequest(actor="dave", reason="lunch"), metadata=AUTH)
    control.Pause(pb.CommandRequest(actor="dave"), metadata=AUTH)  # no-op: no event
    control.Rollback(pb.CommandRequest(actor="dave", reason="bad smell"), metadata=AUTH)
    seen = []
    for event in stream:
        if event.HasField("audit"):
            seen.append((event.audit.action, event.audit.to_state, event.audit.actor))
        if len(seen) == 3:
            break
    stream.cancel()
    assert seen == [("pause", "paused", "dave"), ("rollback", "rolling_back", "dave"),
                    ("rolled_back", "rolled_back", "controller")]


def test_watch_events_needs_the_token(served):
    _, channel, _ = served
    with pytest.raises(grpc.RpcError) as caught:
        next(stub(channel).WatchEvents(pb.WatchRequest(), timeout=5))
    assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED


def test_health_and_reflection_are_served(served):
    _, channel, _ = served
    health = health_pb2_grpc.HealthStub(channel)
    answer = health.Check(health_pb2.HealthCheckRequest(service="spine.v1.MigrationControl"), timeout=5)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING
    reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
    [reply] = list(reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                               timeout=5))
    names = {service.name for service in reply.list_services_response.service}
    assert "spine.v1.MigrationControl" in names and "grpc.health.v1.Health" in names


@pytest.mark.parametrize("listen", ["0.0.0.0:7000", "10.0.0.5:7000", "example.com:7000", "[::]:7000", "unix:"])
def test_the_controller_refuses_to_listen_beyond_loopback(listen):
    with pytest.raises(ConfigError, match="--listen"):
        check_listen(listen)


@pytest.mark.parametrize("listen", ["127.0.0.1:0", "localhost:7000", "[::1]:7000", "unix:/tmp/x.sock"])
def test_loopback_and_unix_addresses_are_accepted(listen):
    assert check_listen(listen) == listen
