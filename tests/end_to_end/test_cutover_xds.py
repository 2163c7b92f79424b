"""A stock proxyless gRPC client (`xds:///spine-gateway`) follows the migration's weights.

The controller's target publishes each stage's weights over ADS; the client — grpcio and a
bootstrap, nothing of spine's — sends real Gateway requests to the real layered stack and
spine, and the layout named in each answer's trailers tells where it landed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from migration.traffic.cutover import Cutover, RunningCutover
from tests.conftest import DEV_KEY, config_for_tests
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(180)

CLIENT = r'''
import json, sys
import grpc
from wire.v1 import generation_pb2

channel = grpc.insecure_channel("xds:///spine-gateway")
generate = channel.unary_unary("/spine.v1.Gateway/Generate",
                               request_serializer=generation_pb2.GenerateRequest.SerializeToString,
                               response_deserializer=generation_pb2.GenerateResponse.FromString)
grpc.channel_ready_future(channel).result(timeout=30)
sys.stdout.write(json.dumps({"ready": True}) + "\n"); sys.stdout.flush()
for line in sys.stdin:
    n = json.loads(line)["n"]
    seen = {}
    for i in range(n):
        request = generation_pb2.GenerateRequest(model="tiny-lm", prompt=f"xds {i}", max_tokens=1)
        try:
            _, call = generate.with_call(request, timeout=10, metadata=[("authorization", "Bearer " + sys.argv[1])])
            layout = dict(call.trailing_metadata())["x-spine-layout"]
        except grpc.RpcError as error:
            layout = "error:" + error.code().name
        seen[layout] = seen.get(layout, 0) + 1
    sys.stdout.write(json.dumps(seen) + "\n"); sys.stdout.flush()
'''

ALL_REMOTE = dict.fromkeys(("auth", "ratelimit", "router", "cache", "metrics", "logs"), "remote")
ALL_LOCAL = dict.fromkeys(ALL_REMOTE, "local")


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningCutover, subprocess.Popen[str]]]:
    cutover = Cutover(config_for_tests(), Path(tmp_path_factory.mktemp("xds-cutover")), xds_listen="127.0.0.1:0").start()
    client: subprocess.Popen[str] | None = None
    try:
        assert cutover.target is not None and cutover.xds is not None and cutover.xds.address
        cutover.target.apply(0, ALL_REMOTE, "stage-0", route_header=True)
        bootstrap = {
            "xds_servers": [{"server_uri": cutover.xds.address, "channel_creds": [{"type": "insecure"}],
                             "server_features": ["xds_v3"]}],
            "node": {"id": "proxyless-client", "cluster": "spine-test"},
        }
        env = dict(os.environ, GRPC_XDS_BOOTSTRAP_CONFIG=json.dumps(bootstrap))
        client = subprocess.Popen([sys.executable, "-c", CLIENT, DEV_KEY], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=env)
        assert client.stdout is not None
        assert json.loads(client.stdout.readline()) == {"ready": True}
        yield cutover, client
    finally:
        if client is not None:
            client.kill()
            client.wait()
        cutover.stop()


def calls(client: subprocess.Popen[str], n: int) -> dict[str, Any]:
    assert client.stdin is not None and client.stdout is not None
    client.stdin.write(json.dumps({"n": n}) + "\n")
    client.stdin.flush()
    return json.loads(client.stdout.readline())


def applied(cutover: RunningCutover, version: str) -> None:
    """Wait until the target says `version` is in force (every data plane ACKed it)."""
    target, xds = cutover.target, cutover.xds
    assert target is not None and xds is not None
    eventually(lambda: target.applied(version), 10, f"{version} ACKed", interval=0.02, seen=xds.status)


def test_the_client_follows_each_stage_and_the_target_waits_for_its_ack(
        rig: tuple[RunningCutover, subprocess.Popen[str]]) -> None:
    cutover, client = rig
    assert cutover.target is not None and cutover.xds is not None
    assert calls(client, 10) == {"layered": 10}

    cutover.target.apply(100, ALL_LOCAL, "stage-full", route_header=True)
    applied(cutover, "stage-full")
    assert any(row["acked_version"] == "stage-full" for row in cutover.xds.status())
    started = time.monotonic()
    seen: dict[str, Any] = {}
    while time.monotonic() - started < 5:
        seen = calls(client, 5)
        if seen == {"collapsed": 5}:
            break
    assert seen == {"collapsed": 5}, seen

    cutover.target.apply(0, ALL_REMOTE, "stage-back", route_header=True)  # rollback
    applied(cutover, "stage-back")
    for _ in range(20):
        seen = calls(client, 5)
        if seen == {"layered": 5}:
            break
    assert seen == {"layered": 5}, seen


def test_a_nack_is_shown_in_migrate_status_and_traffic_stays_on_the_last_good_version(
        rig: tuple[RunningCutover, subprocess.Popen[str]]) -> None:
    from migration.service import status_message
    from migration.xds import Endpoint, build_snapshot
    from migration.xds.snapshot import ROUTE, build_route

    cutover, client = rig
    assert cutover.target is not None and cutover.xds is not None and cutover.controller is not None
    cutover.target.apply(0, ALL_REMOTE, "good", route_header=True)
    applied(cutover, "good")
    endpoints: dict[str, list[Endpoint]] = {}
    for side, stack in (("layered", cutover.layered), ("spine", cutover.spine)):
        assert stack is not None
        host, _, port = stack.address.rpartition(":")
        endpoints[side] = [Endpoint(host, int(port))]
    bad = build_snapshot("spine-gateway", {"layered": 100, "spine": 0}, endpoints, "bad-route")
    (route_name,) = bad.resources[ROUTE]
    bad.resources[ROUTE] = {route_name: build_route(route_name, {"layered": 0, "spine": 0})}
    cutover.xds.publish(bad)
    controller = cutover.controller.controller
    def nacked_status() -> Any:
        status = status_message(controller.view())
        return status if any(p.nack_error for p in status.data_planes) else None

    status = eventually(nacked_status, 10, "the bad route NACKed", interval=0.05)
    nacked = [p for p in status.data_planes if p.nack_error]
    assert nacked and nacked[0].type == "RDS" and nacked[0].nacked_version == "bad-route"
    assert nacked[0].acked_version == "good"
    assert not cutover.target.applied("bad-route")
    assert calls(client, 10) == {"layered": 10}

    from io import StringIO

    from rich.console import Console

    from migration.render import status_renderable

    out = StringIO()
    Console(file=out, width=200).print(status_renderable(status))
    assert "xDS data planes" in out.getvalue() and "bad-route" in out.getvalue()


def test_a_spine_that_cannot_run_its_model_is_failed_over_and_sent_unhealthy(
        rig: tuple[RunningCutover, subprocess.Popen[str]]) -> None:
    from envoy.config.core.v3 import health_check_pb2

    from migration.xds.snapshot import ENDPOINT
    from spine.client.gateway_client import GatewayClient
    from wire.v1 import generation_pb2

    cutover, _ = rig
    assert cutover.target and cutover.spine and cutover.front and cutover.xds and cutover.endpoint_health
    assert cutover.spine.deep_health is not None
    # ratelimit stays shared: with the spine's own limiter at 100% the layered side keeps only
    # a sliver of every limit, and failed-over requests would be refused until the rollback.
    cutover.target.apply(100, {**ALL_LOCAL, "ratelimit": "remote"}, "health-full", route_header=True)
    model = cutover.spine.local_servicers["inference"].first.backend.model

    def broken_device(*_: object) -> None:
        raise RuntimeError("CUDA error: device lost")

    model.step = broken_device  # the spine's device fails: its deep health must notice
    try:
        assert cutover.spine.deep_health.check_once() is False
        assert cutover.endpoint_health.check_once() == {"layered": True, "spine": False}
        since = time.time()
        with GatewayClient(cutover.address, DEV_KEY) as client:
            results = [client.generate(generation_pb2.GenerateRequest(model="tiny-lm", prompt=f"hc {i}",
                                                                      max_tokens=2)) for i in range(5)]
        assert all(r.ok and r.trailing["x-spine-side"] == "layered" for r in results), [(r.code, r.details, r.trailing) for r in results]
        assert cutover.front.window(since)["spine"].errors == 5  # what the error-rate gate sees
        snapshot = cutover.xds.cache.get("*")
        assert snapshot is not None
        statuses = {name: [ep.health_status for lle in cla.endpoints for ep in lle.lb_endpoints]
                    for name, cla in snapshot.resources[ENDPOINT].items()}
        assert statuses["spine"] == [health_check_pb2.UNHEALTHY]
        assert statuses["layered"] == [health_check_pb2.HEALTHY]
    finally:
        del model.step
        cutover.spine.deep_health.check_once()
        cutover.endpoint_health.check_once()
    assert cutover.front.healthy == {"layered": True, "spine": True}
