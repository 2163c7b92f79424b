"""The standalone controller (`--target xds`): weights over ADS, gates on each side's metrics.

Two real spine stacks stand in for the two sides; this test sends their traffic itself (as
Envoy would, by the weights) and the controller judges the stage on what the sides' own
metrics say — scraped directly, or queried from a real Prometheus server scraping them —
the way it runs in a cluster, where it never sees a request.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.type.matcher.v3 import string_pb2
from prometheus_client.parser import text_string_to_metric_families

from migration.controller import Controller
from migration.gates import ParityStats, WindowStats
from migration.plan import load_plan
from migration.target import ShadowCapability
from migration.traffic.xds_target import XdsTarget
from migration.xds import Endpoint, XdsControlPlane
from migration.xds.snapshot import ROUTE
from runtime.config.file import placements_for
from runtime.running_stack import RunningStack
from runtime.server import free_port, wait_serving
from runtime.stack import Stack
from tests.conftest import DEV_KEY, config_for_tests
from tests.prometheus_server import run_prometheus
from tests.waiting import eventually
from wire.v1 import migration_pb2, migration_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
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
def sides(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RunningStack]]:
    config = config_for_tests()
    tmp = tmp_path_factory.mktemp("xds-target")
    stacks = {}
    try:
        for side in ("layered", "spine"):
            stacks[side] = Stack(config, placements_for("collapsed", config), run_dir=tmp / side).start()
        yield stacks
    finally:
        for stack in stacks.values():
            stack.stop()


def test_the_controller_walks_a_plan_on_metrics_it_scrapes(sides: dict[str, RunningStack], tmp_path: Path) -> None:
    metrics = ["--layered-metrics", f"http://{sides['layered'].metrics_address()}/metrics",
               "--spine-metrics", f"http://{sides['spine'].metrics_address()}/metrics"]
    walk_plan(sides, tmp_path, metrics, PLAN)


def test_the_controller_walks_a_plan_on_promql_from_a_real_prometheus(sides: dict[str, RunningStack], tmp_path: Path) -> None:
    """Both stacks run the collapsed layout, so their series carry the same `layout` label:
    the sides are told apart by the job Prometheus scrapes them under."""
    jobs = {side: [stack.metrics_address()] for side, stack in sides.items()}
    with run_prometheus(tmp_path / "prometheus", jobs) as prometheus:
        metrics = ["--prometheus-url", prometheus.url,
                   "--layered-selector", 'job="layered"', "--spine-selector", 'job="spine"']
        walk_plan(sides, tmp_path, metrics, PROMQL_PLAN)


class NoMetrics:
    """A MetricsSource that reads nothing: these tests only look at what is published."""

    def window(self, side: str, since: float) -> WindowStats:
        return WindowStats(0, 0, 0.0, missing="not read")

    def parity(self, since: float) -> ParityStats:
        return ParityStats(0, 0, missing="not read")

    def shadow_exported(self) -> ShadowCapability:
        return ShadowCapability(True, "not read")

    def close(self) -> None:
        pass


def forced_routes(plane: XdsControlPlane) -> dict[str, list[route_components_pb2.HeaderMatcher]]:
    """Cluster → header matchers of every route that matches on a header, as published."""
    snapshot = plane.cache.get("proxyless-client")
    assert snapshot is not None
    (route,) = snapshot.of_type(ROUTE).values()
    assert isinstance(route, route_pb2.RouteConfiguration)
    (vhost,) = route.virtual_hosts
    assert vhost.routes[-1].route.HasField("weighted_clusters") and not vhost.routes[-1].match.headers
    return {r.route.cluster: list(r.match.headers) for r in vhost.routes if r.match.headers}


def header(side: str) -> route_components_pb2.HeaderMatcher:
    return route_components_pb2.HeaderMatcher(name="x-spine-route", string_match=string_pb2.StringMatcher(exact=side))


@pytest.mark.parametrize("route_header", [True, False])
def test_the_xds_route_follows_the_plans_route_header_across_a_restart(tmp_path: Path, route_header: bool) -> None:
    """A real controller on sqlite and a real control plane: the stable state forces nothing;
    the plan's `route_header` decides whether `x-spine-route` routes are published, at its
    stage and again when a restarted controller re-applies it; a rollback keeps it."""
    endpoints = {"layered": [Endpoint("127.0.0.1", 7001)], "spine": [Endpoint("127.0.0.1", 7002)]}
    plan = load_plan(f"route_header: {str(route_header).lower()}\n" + PLAN)
    expected = {side: [header(side)] for side in ("layered", "spine")} if route_header else {}
    db = str(tmp_path / "rollout.db")
    for run in ("first", "restarted"):
        plane = XdsControlPlane("spine-gateway", endpoints)
        target = XdsTarget(plane, NoMetrics(), min_spine_replicas=0)
        controller = Controller.open(db, target)
        if run == "first":
            target.serve_stable()
            assert plane.version == "stable" and forced_routes(plane) == {}
            controller.start(plan, "test")
        else:
            assert plane.version == controller.status.version  # re-applied on open
        assert forced_routes(plane) == expected, run
        controller.close()
        target.close()
    plane = XdsControlPlane("spine-gateway", endpoints)
    target = XdsTarget(plane, NoMetrics())
    controller = Controller.open(db, target)
    controller.rollback("test")
    assert controller.status.spine_weight == 0 and forced_routes(plane) == expected
    controller.close()
    target.close()


# The data plane: a stock gRPC client on `xds:///spine-gateway`, nothing but grpcio and the
# bootstrap from the environment, sending Generate calls until told to stop.
DATA_PLANE = r"""
import json, sys, threading, grpc
from wire.v1 import gateway_pb2_grpc, generation_pb2
channel = grpc.insecure_channel("xds:///spine-gateway")
stub = gateway_pb2_grpc.GatewayStub(channel)
counts, stop = {}, threading.Event()
def loop():
    i = 0
    while not stop.is_set():
        try:
            stub.Generate(generation_pb2.GenerateRequest(model="tiny-lm", prompt=f"xds {i}", max_tokens=2),
                          metadata=[("authorization", "Bearer %s")], timeout=5)
            code = "OK"
        except grpc.RpcError as error:
            code = error.code().name
        counts[code] = counts.get(code, 0) + 1
        i += 1
thread = threading.Thread(target=loop)
thread.start()
for line in sys.stdin:
    if line.strip() == "counts":
        print(json.dumps(counts), flush=True)
    else:
        break
stop.set()
thread.join()
"""


def served_requests(stack: RunningStack) -> float:
    stack.drain()
    text = stack.local_servicers["metrics"].render()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "spine_requests_total")


def walk_plan(sides: dict[str, RunningStack], tmp_path: Path, metrics: list[str], plan: str) -> None:
    """Run the controller on `metrics` with a proxyless gRPC client as the data plane: the
    client reaches the layered side before any plan (the stable state), the controller counts
    a stage applied only once that client ACKed it, and `plan` is promoted on an error-rate
    gate that passed at least once."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    listen = f"unix:{tmp_path / 'controller.sock'}"
    ads = f"127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "migration.runner", "--db", str(tmp_path / "rollout.db"), "--listen", listen,
            "--admin-token-file", str(token_file), "--target", "xds", "--xds-listen", ads,
            "--layered", sides["layered"].address, "--spine", sides["spine"].address, *metrics,
            # Weights only: these spines keep their own placements (tests/integration/test_stage_followers.py
            # has spine replicas and rate limiters following the stage).
            "--min-spine-replicas", "0"]
    controller = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    bootstrap = {"xds_servers": [{"server_uri": ads, "channel_creds": [{"type": "insecure"}],
                                  "server_features": ["xds_v3"]}],
                 "node": {"id": "proxyless-data-plane", "cluster": "spine-test"}}
    env = dict(os.environ, GRPC_XDS_BOOTSTRAP_CONFIG=json.dumps(bootstrap))
    client: subprocess.Popen[str] | None = None
    try:
        assert wait_serving(listen, timeout=30), controller.stderr.read() if controller.poll() is not None else ""
        layered_before = served_requests(sides["layered"])
        client = subprocess.Popen([sys.executable, "-c", DATA_PLANE % DEV_KEY], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        with grpc.insecure_channel(listen) as channel:
            stub = migration_pb2_grpc.MigrationControlStub(channel)
            md = [("authorization", f"Bearer {TOKEN}")]
            status = stub.Status(migration_pb2.StatusRequest(), metadata=md, timeout=10)
            assert status.state == "pending" and status.min_data_planes == 1
            eventually(lambda: served_requests(sides["layered"]) >= layered_before + 5, 30,  # the stable state
                       "the data plane reaching the layered side before a plan", interval=0.2)
            stub.Start(migration_pb2.StartRequest(plan_yaml=plan, actor="test"), metadata=md, timeout=10)
            gates_seen = []

            def promoted() -> Any:
                status = stub.Status(migration_pb2.StatusRequest(), metadata=md, timeout=10)
                gates_seen.extend(status.last_gates)
                return status if status.state == "promoted" else None

            status = eventually(promoted, 60, "the plan promoted", interval=0.2, seen=lambda: gates_seen[-3:])
        assert status.state == "promoted", status
        assert status.spine_weight == 100 and status.applied
        assert any(p.node_id == "proxyless-data-plane" and p.acked_version == status.version
                   for p in status.data_planes), status.data_planes
        passed = [g for g in gates_seen if g.gate == "error_rate" and g.verdict == "pass"]
        assert passed, f"the error-rate gate never passed a window: {[g.message for g in gates_seen]}"
        assert client.stdin is not None and client.stdout is not None
        client.stdin.write("counts\n")
        client.stdin.flush()
        counts = json.loads(client.stdout.readline())
        assert counts.get("OK", 0) > 20 and set(counts) == {"OK"}, counts
    finally:
        if client is not None:
            if client.stdin is not None:
                client.stdin.close()
            try:
                client.wait(timeout=15)
            except subprocess.TimeoutExpired:
                client.kill()
        controller.terminate()
        controller.wait(timeout=15)
    assert controller.returncode == 0
