"""A stock gRPC client (`xds:///spine-gateway`) follows the control plane's weights, and
`x-spine-route` only where the stage turns the route header on.

The client runs in a subprocess: gRPC reads GRPC_XDS_BOOTSTRAP_CONFIG once per process, and the
bootstrap must point at this test's control plane. The backends answer with their own name, so
the client can count where each call landed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from migration.xds import Endpoint, XdsControlPlane, build_snapshot
from migration.xds.snapshot import CLUSTER, ROUTE, build_route
from tests.waiting import holds_within

pytestmark = pytest.mark.timeout(90)

METHOD = "/spine.test.Echo/Who"

# The data plane under test: nothing but grpcio and the bootstrap from the environment.
CLIENT = r'''
import json, sys, threading, time
import grpc

channel = grpc.insecure_channel("xds:///spine-gateway")
who = channel.unary_unary("/spine.test.Echo/Who")
grpc.channel_ready_future(channel).result(timeout=20)
background = None

def call(counts, metadata=None):
    try:
        name = who(b"", timeout=5, metadata=metadata).decode()
    except grpc.RpcError as err:
        counts.setdefault("errors", []).append(str(err.code()))
        return None
    counts[name] = counts.get(name, 0) + 1
    return name

def loop(counts, stop):
    while not stop.is_set():
        call(counts)

def reply(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()

reply({"ready": True})
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["cmd"] == "count":
        counts, metadata = {}, [tuple(pair) for pair in cmd.get("metadata", [])]
        for _ in range(cmd["n"]):
            call(counts, metadata)
        reply(counts)
    elif cmd["cmd"] == "until":
        # Calls until `window` consecutive ones land on `backend`; how long that took.
        start, streak, counts = time.monotonic(), 0, {}
        while streak < cmd["window"] and time.monotonic() - start < cmd["timeout"]:
            streak = streak + 1 if call(counts) == cmd["backend"] else 0
        counts["elapsed"] = time.monotonic() - start
        counts["reached"] = streak >= cmd["window"]
        reply(counts)
    elif cmd["cmd"] == "start":
        counts, stop = {}, threading.Event()
        background = (threading.Thread(target=loop, args=(counts, stop)), counts, stop)
        background[0].start()
        reply({})
    elif cmd["cmd"] == "seen":
        reply(dict(background[1]))
    elif cmd["cmd"] == "stop":
        thread, counts, stop = background
        stop.set()
        thread.join()
        reply(counts)
    elif cmd["cmd"] == "quit":
        break
'''


@dataclass
class Rig:
    plane: XdsControlPlane
    endpoints: dict[str, list[Endpoint]]
    client: subprocess.Popen[str]
    stderr: Any

    def ask(self, **cmd: Any) -> dict[str, Any]:
        assert self.client.stdin is not None and self.client.stdout is not None
        self.client.stdin.write(json.dumps(cmd) + "\n")
        self.client.stdin.flush()
        line = self.client.stdout.readline()
        if not line:
            self.stderr.seek(0)
            raise AssertionError(f"xDS client exited: {self.stderr.read()[-4000:]}")
        return json.loads(line)

    def wait_seen(self, backend: str, at_least: int, timeout: float = 10.0) -> bool:
        """Poll the running client until `backend` has answered `at_least` calls in all."""
        return holds_within(lambda: self.ask(cmd="seen").get(backend, 0) >= at_least, timeout, interval=0.005)

    def shift(self, layered: int, spine: int, version: str, *, route_header: bool = False) -> None:
        self.plane.set_weights(layered, spine, version, route_header=route_header)
        assert self.plane.wait_acked(version, timeout=10, min_nodes=1), self.plane.status()


def backend(name: str) -> tuple[grpc.Server, int]:
    def who(request: bytes, context: grpc.ServicerContext) -> bytes:
        return name.encode()

    handler = grpc.method_handlers_generic_handler(
        "spine.test.Echo", {"Who": grpc.unary_unary_rpc_method_handler(who)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    (layered, lport), (spine, sport) = backend("layered"), backend("spine")
    endpoints = {"layered": [Endpoint("127.0.0.1", lport)], "spine": [Endpoint("127.0.0.1", sport)]}
    plane = XdsControlPlane("spine-gateway", endpoints)
    address = plane.start("127.0.0.1:0")
    plane.set_weights(30, 70, "start")
    bootstrap = {
        "xds_servers": [
            {"server_uri": address, "channel_creds": [{"type": "insecure"}], "server_features": ["xds_v3"]}
        ],
        "node": {"id": "stock-grpc-client", "cluster": "spine-test"},
    }
    env = dict(os.environ, GRPC_XDS_BOOTSTRAP_CONFIG=json.dumps(bootstrap))
    with tempfile.TemporaryFile("w+") as stderr:
        client = subprocess.Popen(
            [sys.executable, "-c", CLIENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
            text=True, env=env,
        )
        try:
            assert client.stdout is not None and client.stdin is not None
            assert json.loads(client.stdout.readline() or "{}") == {"ready": True}, "client did not start"
            yield Rig(plane, endpoints, client, stderr)
        finally:
            if client.poll() is None:
                client.stdin.write('{"cmd": "quit"}\n')  # type: ignore[union-attr]
                client.stdin.flush()  # type: ignore[union-attr]
                try:
                    client.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    client.kill()
                    client.wait()
            for pipe in (client.stdin, client.stdout):
                if pipe is not None:
                    pipe.close()
            plane.stop(grace=0)
            layered.stop(0)
            spine.stop(0)


def test_observed_split_follows_weights_within_three_points(rig: Rig) -> None:
    rig.shift(30, 70, "split-30-70")
    rig.ask(cmd="count", n=100)  # the ACK precedes the channel applying it by a few calls
    counts = rig.ask(cmd="count", n=4000)
    assert "errors" not in counts, counts
    share = counts.get("layered", 0) / 4000
    assert abs(share - 0.30) <= 0.03, counts


def test_weight_change_is_followed_within_one_second(rig: Rig) -> None:
    rig.shift(100, 0, "all-layered")
    assert rig.ask(cmd="until", backend="layered", window=50, timeout=5)["reached"]
    rig.plane.set_weights(0, 100, "all-spine")
    seen = rig.ask(cmd="until", backend="spine", window=50, timeout=5)
    assert seen["reached"] and "errors" not in seen, seen
    assert seen["elapsed"] < 1.0, seen


def test_no_rpc_fails_during_ten_back_and_forth_shifts(rig: Rig) -> None:
    rig.shift(100, 0, "shift-base")
    rig.ask(cmd="count", n=100)
    rig.ask(cmd="start")  # calls run continuously while the weights move under them
    for i in range(10):
        for layered, spine, side in ((0, 100, "spine"), (100, 0, "layered")):
            before = rig.ask(cmd="seen").get(side, 0)
            rig.shift(layered, spine, f"shift-{i}-{side}")
            # The shift has taken effect once calls keep landing on the new side.
            assert rig.wait_seen(side, before + 20), rig.ask(cmd="seen")
    counts = rig.ask(cmd="stop")
    assert counts.get("errors", []) == [], counts


def test_x_spine_route_reaches_a_weight_0_spine_only_with_the_route_header_on(rig: Rig) -> None:
    forced = [["x-spine-route", "spine"]]
    rig.shift(100, 0, "route-header-on", route_header=True)
    rig.ask(cmd="count", n=50, metadata=forced)  # the ACK precedes the channel applying it by a few calls
    assert rig.ask(cmd="count", n=100, metadata=forced) == {"spine": 100}
    assert rig.ask(cmd="count", n=100) == {"layered": 100}
    rig.shift(100, 0, "route-header-off", route_header=False)
    rig.ask(cmd="count", n=50, metadata=forced)
    assert rig.ask(cmd="count", n=100, metadata=forced) == {"layered": 100}


def test_rejected_route_is_nacked_and_traffic_stays_on_last_good_version(rig: Rig) -> None:
    rig.shift(100, 0, "good")
    rig.ask(cmd="count", n=50)
    bad = build_snapshot("spine-gateway", {"layered": 100, "spine": 0}, rig.endpoints, "bad-route")
    (route_name,) = bad.resources[ROUTE]
    bad.resources[ROUTE] = {route_name: build_route(route_name, {"layered": 0, "spine": 0})}
    rig.plane.publish(bad)
    assert rig.plane.ads.wait_for(lambda: _nack(rig, "RDS") is not None, timeout=10), rig.plane.status()
    row = _nack(rig, "RDS")
    assert row is not None and "no valid clusters" in row["nack_error"]
    assert row["acked_version"] == "good"
    assert not rig.plane.acked("bad-route")
    counts = rig.ask(cmd="count", n=300)
    assert counts == {"layered": 300}, counts
    rig.shift(50, 50, "recovered")  # the next good version is accepted and clears the error
    assert _nack(rig, "RDS") is None


def test_rejected_cluster_is_nacked_and_traffic_keeps_flowing(rig: Rig) -> None:
    rig.shift(0, 100, "good-2")
    rig.ask(cmd="count", n=50)
    bad = build_snapshot("spine-gateway", {"layered": 0, "spine": 100}, rig.endpoints, "bad-cluster")
    spine = bad.resources[CLUSTER]["spine"]
    spine.lb_policy = spine.MAGLEV  # type: ignore[attr-defined]  # gRPC supports no MAGLEV
    rig.plane.publish(bad)
    assert rig.plane.ads.wait_for(lambda: _nack(rig, "CDS") is not None, timeout=10), rig.plane.status()
    assert not rig.plane.acked("bad-cluster")
    counts = rig.ask(cmd="count", n=300)
    assert counts == {"spine": 300}, counts
    rig.shift(100, 0, "recovered-2")


def _nack(rig: Rig, type_name: str) -> dict[str, Any] | None:
    for row in rig.plane.status():
        if row["type"] == type_name and row["nack_error"]:
            return row
    return None
