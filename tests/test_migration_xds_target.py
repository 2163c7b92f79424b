"""The standalone controller (`--target xds`): weights over ADS, gates on each side's metrics.

Two real spine stacks stand in for the two sides; this test sends their traffic itself (as
Envoy would, by the weights) and the controller judges the stage on what the sides' own
metrics say — scraped directly, or queried from a real Prometheus server scraping them —
the way it runs in a cluster, where it never sees a request.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from spine.client.gateway_client import GatewayClient
from spine.runtime.config import placements_for
from spine.runtime.server import wait_serving
from spine.runtime.stack import Stack
from spine.v1 import generation_pb2, migration_pb2, migration_pb2_grpc
from tests.conftest import DEV_KEY, config_for_tests
from tests.prometheus_server import run_prometheus

TOKEN = "test-admin-token-0123456789"
PLAN = """
name: xds-quick
window_s: 0.5
min_window_requests: 3
stages:
  - name: half
    spine_weight: 50
    hold_s: 1
    gates:
      - {type: error_rate, max_delta: 0.05}
      - {type: latency_p99_ratio, max_ratio: 50}
  - name: all
    spine_weight: 100
    hold_s: 0.5
"""
# PromQL's increase() needs two scrapes of a series inside a window: 2 s windows over 0.5 s scrapes.
PROMQL_PLAN = PLAN.replace("window_s: 0.5", "window_s: 2").replace("hold_s: 1", "hold_s: 2")


@pytest.fixture(scope="module")
def sides(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Stack]]:
    config = config_for_tests()
    tmp = tmp_path_factory.mktemp("xds-target")
    stacks = {}
    try:
        for side in ("layered", "spine"):
            stacks[side] = Stack(config, placements_for("collapsed", config), run_dir=tmp / side)
            stacks[side].start()
        yield stacks
    finally:
        for stack in stacks.values():
            stack.stop()


def test_the_controller_walks_a_plan_on_metrics_it_scrapes(sides: dict[str, Stack], tmp_path: Path) -> None:
    metrics = ["--layered-metrics", f"http://{sides['layered'].metrics_address()}/metrics",
               "--spine-metrics", f"http://{sides['spine'].metrics_address()}/metrics"]
    walk_plan(sides, tmp_path, metrics, PLAN)


def test_the_controller_walks_a_plan_on_promql_from_a_real_prometheus(sides: dict[str, Stack], tmp_path: Path) -> None:
    """Both stacks run the collapsed layout, so their series carry the same `layout` label:
    the sides are told apart by the job Prometheus scrapes them under."""
    jobs = {side: [stack.metrics_address()] for side, stack in sides.items()}
    with run_prometheus(tmp_path / "prometheus", jobs) as prometheus:
        metrics = ["--prometheus-url", prometheus.url,
                   "--layered-selector", 'job="layered"', "--spine-selector", 'job="spine"']
        walk_plan(sides, tmp_path, metrics, PROMQL_PLAN)


def walk_plan(sides: dict[str, Stack], tmp_path: Path, metrics: list[str], plan: str) -> None:
    """Run the controller on `metrics`, send both sides traffic, expect `plan` promoted on
    an error-rate gate that passed at least once."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    listen = f"unix:{tmp_path / 'controller.sock'}"
    argv = [sys.executable, "-m", "migration.runner", "--db", str(tmp_path / "rollout.db"), "--listen", listen,
            "--admin-token-file", str(token_file), "--target", "xds", "--xds-listen", "127.0.0.1:0",
            "--layered", sides["layered"].address, "--spine", sides["spine"].address, *metrics]
    controller = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stop = threading.Event()

    def traffic() -> None:  # what the data planes would send, to both sides
        clients = {side: GatewayClient(stack.address, DEV_KEY) for side, stack in sides.items()}
        i = 0
        while not stop.is_set():
            for client in clients.values():
                client.generate(generation_pb2.GenerateRequest(model="tiny-lm", prompt=f"xds {i}", max_tokens=2))
            i += 1
        for client in clients.values():
            client.close()

    sender = threading.Thread(target=traffic)
    try:
        assert wait_serving(listen, timeout=30), controller.stderr.read() if controller.poll() is not None else ""
        sender.start()
        with grpc.insecure_channel(listen) as channel:
            stub = migration_pb2_grpc.MigrationControlStub(channel)
            md = [("authorization", f"Bearer {TOKEN}")]
            stub.Start(migration_pb2.StartRequest(plan_yaml=plan, actor="test"), metadata=md, timeout=10)
            deadline = time.monotonic() + 40
            status = stub.Status(migration_pb2.StatusRequest(), metadata=md, timeout=10)
            gates_seen = []
            while status.state != "promoted" and time.monotonic() < deadline:
                time.sleep(0.2)
                status = stub.Status(migration_pb2.StatusRequest(), metadata=md, timeout=10)
                gates_seen.extend(status.last_gates)
        assert status.state == "promoted", status
        assert status.spine_weight == 100 and status.applied
        passed = [g for g in gates_seen if g.gate == "error_rate" and g.verdict == "pass"]
        assert passed, f"the error-rate gate never passed a window: {[g.message for g in gates_seen]}"
    finally:
        stop.set()
        if sender.is_alive():
            sender.join(timeout=30)
        controller.terminate()
        controller.wait(timeout=15)
    assert controller.returncode == 0
