"""The standalone controller (`--target xds`): weights over ADS, gates on Prometheus metrics.

Two real spine stacks stand in for the two sides; this test sends their traffic itself (as
Envoy would, by the weights) and the controller reads each side's /metrics to judge the
stage — the way it runs in a cluster, where it never sees a request.
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

from migration.prometheus_window import p99_ms, parse_totals
from monolith.device import DeviceContext
from services.metrics import MetricsConfig, MetricsService
from spine.client.gateway_client import GatewayClient
from spine.runtime.config import placements_for
from spine.runtime.server import wait_serving
from spine.runtime.stack import Stack
from spine.v1 import generation_pb2, metrics_pb2, migration_pb2, migration_pb2_grpc
from tests.conftest import DEV_KEY, config_for_tests

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


def test_totals_and_p99_come_from_the_metrics_text() -> None:
    service = MetricsService(MetricsConfig.from_dict({}), DeviceContext())
    for latency, status in [(0.001, "OK")] * 98 + [(0.2, "UNAVAILABLE"), (0.0004, "INVALID_ARGUMENT")]:
        service.Record(metrics_pb2.RequestRecord(layout="layered", model="m", tenant="t", status=status,
                                                 latency_s=latency), None)
    service.Record(metrics_pb2.RequestRecord(layout="layered", model="m", tenant="t", status="UNAVAILABLE",
                                             latency_s=5.0, shadow=True), None)
    totals = parse_totals(service.render())
    assert totals.requests == 100  # the shadow request is left out
    assert totals.errors == 1      # INVALID_ARGUMENT is the client's doing, not the layout's
    assert 1.0 <= p99_ms(totals.buckets) <= 5.0


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
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    listen = f"unix:{tmp_path / 'controller.sock'}"
    argv = [sys.executable, "-m", "migration.runner", "--db", str(tmp_path / "rollout.db"), "--listen", listen,
            "--admin-token-file", str(token_file), "--target", "xds", "--xds-listen", "127.0.0.1:0",
            "--layered", sides["layered"].address, "--spine", sides["spine"].address,
            "--layered-metrics", f"http://{sides['layered'].metrics_address()}/metrics",
            "--spine-metrics", f"http://{sides['spine'].metrics_address()}/metrics"]
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
            stub.Start(migration_pb2.StartRequest(plan_yaml=PLAN, actor="test"), metadata=md, timeout=10)
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
        assert passed, "the error-rate gate never judged a window of scraped metrics"
    finally:
        stop.set()
        if sender.is_alive():
            sender.join(timeout=30)
        controller.terminate()
        controller.wait(timeout=15)
    assert controller.returncode == 0
