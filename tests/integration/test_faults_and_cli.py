"""Faults in the layered layout, and `spine up` / `spine call` as a person runs them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from runtime.processes.launch import launch, spine_up_argv
from runtime.running_stack import RunningStack
from spine.client.gateway_client import GatewayClient
from tests.conftest import DEV_KEY, pid_alive, start_stack
from tests.http_helpers import sdk_round_trip
from tests.waiting import eventually, holds_within
from wire.v1 import generation_pb2


def gen(prompt: str, max_tokens: int = 4) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(model="tiny-lm", prompt=prompt, max_tokens=max_tokens)


@pytest.fixture(scope="module")
def layered(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    stack = start_stack("layered", tmp_path_factory.mktemp("faults"))
    try:
        yield stack
    finally:
        stack.stop()


def kill_child(stack: RunningStack, name: str) -> int:
    assert stack.supervisor is not None
    child = stack.supervisor.children[name]
    assert child.healthy.is_set()
    pid = child.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    child.process.wait()  # type: ignore[union-attr]
    return pid


def eventually_ok(client: GatewayClient, request: generation_pb2.GenerateRequest, within_s: float = 10.0) -> bool:
    """The gateway's link to a restarted child comes back after its reconnect backoff."""
    return holds_within(lambda: client.generate(request).ok, within_s, interval=0.1)


def wait_restarted(stack: RunningStack, name: str, old_pid: int, timeout: float = 60.0) -> None:
    assert stack.supervisor is not None
    child = stack.supervisor.children[name]
    eventually(lambda: child.pid != old_pid and child.healthy.is_set(), timeout, f"{name} restarted",
               interval=0.05)


@pytest.mark.parametrize("name", ["auth", "ratelimit"])
def test_fail_closed_middleware_down_is_unavailable_within_the_deadline(layered: RunningStack, name: str) -> None:
    with GatewayClient(layered.address, DEV_KEY) as client:
        assert client.generate(gen(f"before {name} dies")).ok
        old = kill_child(layered, name)
        started = time.monotonic()
        result = client.generate(gen(f"while {name} is down"), timeout=2.0)
        elapsed = time.monotonic() - started
        if result.ok:  # the supervisor was faster than our request; that is allowed
            assert layered.supervisor is not None and layered.supervisor.children[name].pid != old
        else:
            assert result.code == grpc.StatusCode.UNAVAILABLE, result.details
            assert name in result.details
            assert ".sock" not in result.details and "unix:" not in result.details  # no internal address
            assert elapsed < 2.5
        wait_restarted(layered, name, old)
        assert eventually_ok(client, gen(f"after {name} restarted"))
    assert layered.supervisor is not None and layered.supervisor.children[name].restarts >= 1


def test_fail_open_middleware_down_lets_requests_through_and_counts(layered: RunningStack) -> None:
    assert layered.gateway is not None
    before = layered.gateway.fail_open_failures["cache"]
    with GatewayClient(layered.address, DEV_KEY) as client:
        old = kill_child(layered, "cache")
        result = client.generate(gen("cache is down"))
        assert result.ok, result.details
        if layered.supervisor is not None and layered.supervisor.children["cache"].pid == old:
            assert layered.gateway.fail_open_failures["cache"] > before
        wait_restarted(layered, "cache", old)
        assert eventually_ok(client, gen("cache is back"))


def test_children_carry_health_and_reflection(layered: RunningStack) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    assert layered.supervisor is not None
    address = layered.supervisor.children["router"].address
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="spine.v1.Router"), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for reply in replies for s in reply.list_services_response.service}
    assert "spine.v1.Router" in names and "grpc.health.v1.Health" in names


def spine_up(layout: str, run_dir: Path) -> tuple[subprocess.Popen[bytes], dict[str, object]]:
    """`spine up` started as every tool starts a layout (`runtime.processes.launch`); its root process
    (the tests signal it themselves) and its ready line."""
    launched = launch(f"spine up {layout}", spine_up_argv(None, layout, listen="127.0.0.1:0", http_listen="127.0.0.1:0",
                                                         run_dir=run_dir), log_path=run_dir.parent / f"{layout}.log")
    return launched.process, launched.wait_ready(120)


def test_spine_up_layered_sigterm_stops_every_child_and_flushes_logs(tmp_path: Path) -> None:
    process, ready = spine_up("layered", tmp_path / "run")
    try:
        assert ready["layout"] == "layered"
        children = ready["children"]
        assert isinstance(children, dict) and set(children) == {
            "auth", "ratelimit", "router", "cache", "metrics", "logs", "inference"}
        health = ready["health"]  # the gateway's, each component's, each child's state
        assert isinstance(health, dict) and health["serving"] is True
        assert {name: state["serving"] for name, state in health["components"].items()} == dict.fromkeys(children, True)
        assert {state["state"] for state in health["children"].values()} == {"serving"}
        call = subprocess.run([sys.executable, "-m", "spine", "call", "--address", str(ready["address"]),
                               "--prompt", "from the cli", "--json"], capture_output=True, text=True, timeout=60)
        answer = json.loads(call.stdout)
        assert call.returncode == 0 and answer["status"] == "OK"
        assert answer["trailing"]["x-spine-layout"] == "layered"
        sdk_round_trip(str(ready["http_address"]))  # the HTTP API, from the same gateway process
        # The gateway keeps no tensors when every component is remote: it never loads torch
        # (the step classes live apart from the servicers that keep tables); the model does.
        assert "libtorch" not in Path(f"/proc/{process.pid}/maps").read_text()
        assert "libtorch" in Path(f"/proc/{children['inference']}/maps").read_text()
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    assert process.returncode == 0
    assert not [pid for pid in children.values() if pid_alive(int(pid))], "orphan children"
    lines = (tmp_path / "run" / "requests.jsonl").read_text().splitlines()
    logged = [json.loads(line) for line in lines]
    assert any(entry["request_id"] == answer["trailing"]["x-request-id"] for entry in logged)
    assert all(DEV_KEY not in line for line in lines)


def test_spine_up_collapsed_serves_and_call_reports_errors(tmp_path: Path) -> None:
    process, ready = spine_up("collapsed", tmp_path / "run")
    try:
        assert ready["children"] == {}
        bad = subprocess.run([sys.executable, "-m", "spine", "call", "--address", str(ready["address"]),
                              "--token", "wrong", "--json"], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 1
        assert json.loads(bad.stdout)["status"] == "UNAUTHENTICATED"
        streamed = subprocess.run([sys.executable, "-m", "spine", "call", "--address", str(ready["address"]),
                                   "--stream", "--json", "--seed", "3", "--temperature", "0.7"],
                                  capture_output=True, text=True, timeout=60)
        assert json.loads(streamed.stdout)["status"] == "OK"
        sdk_round_trip(str(ready["http_address"]))  # the HTTP API, from the same process
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    assert process.returncode == 0
    assert (tmp_path / "run" / "requests.jsonl").read_text().count("\n") == 4  # 2 over gRPC, 2 over HTTP


def test_supervisor_death_takes_its_children_along(tmp_path: Path) -> None:
    process, ready = spine_up("layered", tmp_path / "run")
    children = ready["children"]
    assert isinstance(children, dict)
    process.kill()  # SIGKILL: the supervisor gets no chance to clean up
    process.wait(timeout=10)
    eventually(lambda: not any(pid_alive(int(pid)) for pid in children.values()), 15, "every child gone",
               interval=0.1, seen=lambda: [name for name, pid in children.items() if pid_alive(int(pid))])
