"""The gateway's health tells the truth: NOT_SERVING while a fail-closed component is dead,
stopped or not serving, SERVING when it is back; the front, the A/B tool and a crash loop
all see it. Real processes, real gRPC; SIGSTOP only on children these tests started.

Bounds: the issue asks for NOT_SERVING within 2 s; the asserts allow 1 s more for a loaded
2-core machine, and print what was measured.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from migration.traffic.endpoint_health import EndpointHealth
from migration.traffic.front import Front
from runtime.health.watch import HealthWatch
from runtime.running_stack import RunningStack
from runtime.server import start_server
from runtime.stack import Stack
from services.registry import DEFAULT, GATEWAY
from spine.client.gateway_client import GatewayClient
from spine.tools.ab.interleave import LayoutRun, RunOptions, run_interleaved
from spine.tools.workload.generator import SyntheticSpec, synthetic, tenant_keys
from tests.conftest import DEV_KEY, config_for_tests, start_stack, stop_process
from tests.unit.test_supervisor import refused_config, seconds_until
from wire.v1 import generation_pb2

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
BOUND_S = 2.0 + 1.0  # the 2 s, plus slack for a loaded machine


@pytest.fixture(scope="module")
def layered(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    stack = start_stack("layered", tmp_path_factory.mktemp("gateway-health"))
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def spine(layered: RunningStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    """A collapsed spine that may bind auth to the layered stack's auth process (as a spine in
    mid-migration does)."""
    assert layered.supervisor is not None
    stack = Stack(config_for_tests(), dict.fromkeys(DEFAULT.names, "local"),
                  run_dir=tmp_path_factory.mktemp("spine"),
                  remote_addresses={"auth": layered.supervisor.children["auth"].address}).start()
    try:
        yield stack
    finally:
        stack.stop()


def status(address: str, service: str = "") -> int | None:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=2.0)
        except grpc.RpcError:
            return None
    return int(reply.status)


@contextlib.contextmanager
def stopped(stack: RunningStack, name: str) -> Iterator[int]:
    """SIGSTOP a child of `stack` (started by this test module); SIGCONT it whatever happens."""
    assert stack.supervisor is not None
    pid = stack.supervisor.children[name].pid
    assert pid is not None
    stop_process(pid)
    try:
        yield pid
    finally:
        os.kill(pid, signal.SIGCONT)


def serving(address: str, service: str = "") -> Callable[[], bool]:
    return lambda: status(address, service) == SERVING


def not_serving(address: str, service: str = "") -> Callable[[], bool]:
    return lambda: status(address, service) != SERVING


def gen(prompt: str) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(model="tiny-lm", prompt=prompt, max_tokens=2)


def test_a_stopped_auth_turns_the_gateway_not_serving_within_2s_and_serving_after_sigcont(layered: RunningStack) -> None:
    address = layered.address
    # The module's stack is shared: a test before this one (or a loaded host) may leave a
    # health check just failed; the gateway comes back by itself, as the test then checks.
    seconds_until(serving(address), what="gateway SERVING before the test")
    assert status(address) == SERVING and status(address, GATEWAY.full_name) == SERVING
    assert status(address, "spine.v1.Auth") == SERVING
    with stopped(layered, "auth"), GatewayClient(address, DEV_KEY) as client:
        down_s = seconds_until(not_serving(address), what="gateway NOT_SERVING after SIGSTOP of auth")
        assert status(address, GATEWAY.full_name) == NOT_SERVING
        assert status(address, "spine.v1.Auth") == NOT_SERVING
        assert layered.health is not None and "no health answer" in layered.health.report()["reason"]
        started = time.monotonic()
        results = [client.generate(gen(f"while auth is stopped {i}"), timeout=5.0) for i in range(3)]
        per_request_s = (time.monotonic() - started) / len(results)
        assert {r.code for r in results} <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}
        assert status(address) == NOT_SERVING  # still, while auth stays stopped
    up_s = seconds_until(serving(address), what="gateway SERVING after SIGCONT of auth")
    assert status(address, "spine.v1.Auth") == SERVING
    print(f"\nSIGSTOP auth -> gateway NOT_SERVING in {down_s:.2f}s; SIGCONT -> SERVING in {up_s:.2f}s; "
          f"requests meanwhile: {[r.code.name for r in results]}, {per_request_s:.2f}s each")
    assert down_s <= BOUND_S and up_s <= BOUND_S


def test_a_dead_fail_open_component_is_reported_but_the_gateway_stays_serving(layered: RunningStack) -> None:
    assert layered.supervisor is not None
    child = layered.supervisor.children["cache"]
    old = child.pid
    assert old is not None
    os.kill(old, signal.SIGKILL)
    gateway_states = []

    def cache_reported_down() -> bool:
        gateway_states.append(status(layered.address))
        return status(layered.address, "spine.v1.Cache") == NOT_SERVING

    down_s = seconds_until(cache_reported_down, what="spine.v1.Cache NOT_SERVING")
    assert set(gateway_states) == {SERVING}
    seconds_until(lambda: child.pid != old and status(layered.address, "spine.v1.Cache") == SERVING,
                  timeout=60, what="cache restarted and SERVING")
    assert status(layered.address) == SERVING
    print(f"\ncache killed -> spine.v1.Cache NOT_SERVING in {down_s:.2f}s, gateway SERVING throughout")


def test_the_front_stops_sending_to_a_side_that_is_not_serving(layered: RunningStack, spine: RunningStack) -> None:
    front = Front({"layered": layered.address, "spine": spine.address}, spine_weight=0.0)
    health = EndpointHealth({"layered": [layered.address], "spine": [spine.address]}, front=front).start()
    server = start_server([(GATEWAY, front)], "127.0.0.1:0")
    try:
        with GatewayClient(server.address, DEV_KEY) as client:
            before = client.generate(gen("before"))
            assert before.ok and before.trailing["x-spine-side"] == "layered"
            with stopped(layered, "auth"):
                started = time.monotonic()
                seconds_until(not_serving(layered.address), what="layered gateway NOT_SERVING")
                flipped = time.monotonic()
                seconds_until(lambda: front.route({"authorization": f"Bearer {DEV_KEY}"}) == "spine",
                              what="the front routes to the spine")
                moved_s, total_s = time.monotonic() - flipped, time.monotonic() - started
                during = client.generate(gen("during"))
                assert during.ok and during.trailing["x-spine-side"] == "spine", during.details
            seconds_until(lambda: health.healthy == {"layered": True, "spine": True}, what="layered back")
            after = client.generate(gen("after"))
            assert after.ok and after.trailing["x-spine-side"] == "layered"
    finally:
        server.stop(0.5)
        health.stop()
        front.close()
    print(f"\nfront: traffic left the NOT_SERVING side {moved_s:.2f}s after it flipped "
          f"({total_s:.2f}s after SIGSTOP)")
    assert moved_s <= BOUND_S


def test_the_gateway_health_follows_placements(layered: RunningStack, spine: RunningStack) -> None:
    assert status(spine.address) == SERVING
    try:
        with stopped(layered, "auth"):
            seconds_until(not_serving(layered.address), what="layered gateway NOT_SERVING")
            assert spine.health is not None
            spine.health.check_once()
            assert status(spine.address) == SERVING  # its auth is local: not affected
            spine.set_placements({"auth": "remote"})  # now it is the stopped process
            down_s = seconds_until(not_serving(spine.address), what="spine NOT_SERVING once auth is remote")
            spine.set_placements({"auth": "local"})
            up_s = seconds_until(serving(spine.address), what="spine SERVING once auth is local again")
    finally:
        spine.set_placements({"auth": "local"})
    print(f"\nplacements: auth moved to a stopped process -> NOT_SERVING in {down_s:.2f}s; "
          f"moved back -> SERVING in {up_s:.2f}s")
    assert down_s <= BOUND_S and up_s <= BOUND_S


def test_the_ab_tool_sends_nothing_to_a_layout_that_is_not_serving(layered: RunningStack, spine: RunningStack) -> None:
    entries = synthetic(SyntheticSpec(count=6, rate=50.0, unauthenticated_share=0.0, invalid_share=0.0),
                        tenant_keys(config_for_tests().auth))
    runs = [LayoutRun("layered", layered.address), LayoutRun("spine", spine.address)]
    watch = HealthWatch({run.name: str(run.address) for run in runs}, what="layout").start()
    try:
        with stopped(layered, "auth"):
            seconds_until(lambda: watch.serving == {"layered": False, "spine": True}, what="the A/B watch sees it")
            run_interleaved(runs, entries, RunOptions(mode="closed", concurrency=2, time_limit_s=30, timeout_s=10),
                            serving=lambda name: watch.serving.get(name, True))
    finally:
        watch.stop()
    assert runs[0].not_serving == len(entries) and all(r is None for r in runs[0].results)
    assert runs[1].not_serving == 0 and all(r is not None and r.ok for r in runs[1].results)


def test_a_child_in_a_crash_loop_is_reported_in_the_gateway_health(layered: RunningStack) -> None:
    supervisor = layered.supervisor
    assert supervisor is not None and layered.run_dir is not None and layered.health is not None
    child = supervisor.children["router"]
    with refused_config(layered.run_dir / "config.yaml"):
        pid = child.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        seconds_until(lambda: supervisor.status()["router"]["state"] == "crash_loop", timeout=90,
                      what="router reported in a crash loop")
        seconds_until(lambda: "crash loop" in (layered.health.report()["components"]["router"]["reason"]),
                      what="the crash loop in the gateway's health")
        assert status(layered.address) == NOT_SERVING
        assert status(layered.address, "spine.v1.Router") == NOT_SERVING
        assert "crash loop" in layered.health.report()["reason"]
        report = layered.health_report()
        assert report["serving"] is False and report["children"]["router"]["state"] == "crash_loop"
        exits = list(child.exits)
    delays = [e.delay_s for e in exits]
    gaps = [later.started_at - earlier.exited_at for earlier, later in zip(exits, exits[1:], strict=False)]
    print(f"\ncrash loop: delays {delays}, measured gaps {[round(g, 2) for g in gaps]}")
    assert len(exits) >= 3 and delays == sorted(delays) and delays[-1] > delays[0]
    assert all(gap >= delay for gap, delay in zip(gaps, delays, strict=False))
    # Fixed: the next restart comes up, and once it has stayed up the gateway serves again.
    seconds_until(serving(layered.address), timeout=60, what="gateway SERVING after the config is fixed")
    assert supervisor.status()["router"]["state"] == "serving"
