"""Followers of the controller: spine replicas take a stage's placements, rate limiters their share.

Everything on the path is real: the controller's ADS server and MigrationControl server, the
`StageFollower` streams, `Stack.set_placements`, `RateLimitService` buckets, child processes
(`python -m runtime.process ratelimit --follow-controller`, `spine up
--follow-controller`, `python -m migration.runner`), and requests through real gateways.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from migration.metrics.scrape import ScrapeSource
from migration.server import ControllerProcess
from migration.traffic.xds_target import XdsTarget
from migration.xds import Endpoint, XdsControlPlane
from monolith.device import DeviceContext
from runtime.config.file import placements_for
from runtime.processes.launch import Launched, launch, spine_up_argv
from runtime.running_stack import RunningStack
from runtime.server import free_port, wait_serving
from runtime.stack import Stack
from runtime.stage_follower import (
    ROLE_LAYERED_RATELIMIT,
    ROLE_SPINE,
    StageFollower,
    ratelimit_applier,
    spine_applier,
)
from services.registry import DEFAULT
from spine.cli.migrate import main as migrate
from tests.batch_of_one import one
from tests.conftest import DEV_KEY, SPLIT_KEYS, config_for_tests
from tests.waiting import eventually
from wire.v1 import (
    gateway_pb2_grpc,
    generation_pb2,
    migration_pb2,
    migration_pb2_grpc,
    ratelimit_pb2,
    ratelimit_pb2_grpc,
)

TOKEN = "test-admin-token-0123456789"
MD = [("authorization", f"Bearer {TOKEN}")]
LIMIT = 20  # the split-* tenants' request burst (tests/conftest.py); refill 0.001/s: counts are exact
LOCAL = {"auth": "local", "ratelimit": "local", "router": "local", "cache": "local", "metrics": "local",
         "logs": "local"}


def plan_yaml(name: str, *stages: dict[str, Any]) -> str:
    return yaml.safe_dump({"name": name, "window_s": 600, "min_window_requests": 1,
                           "stages": [{"hold_s": 3600, **stage} for stage in stages]})


@dataclass
class Harness:
    """A controller's MigrationControl API (and, when it runs in this process, its xDS plane)."""

    stub: migration_pb2_grpc.MigrationControlStub
    ads: str
    plane: XdsControlPlane | None = None
    listen: str = ""

    def status(self) -> migration_pb2.RolloutStatus:
        return self.stub.Status(migration_pb2.StatusRequest(), metadata=MD, timeout=10)

    def start(self, plan: str) -> migration_pb2.RolloutStatus:
        return self.stub.Start(migration_pb2.StartRequest(plan_yaml=plan, actor="test"), metadata=MD, timeout=10)

    def applied(self) -> migration_pb2.RolloutStatus | None:
        status = self.status()
        return status if status.applied else None


@contextlib.contextmanager
def controller(tmp: Path, metrics_url: str, *, min_spine: int) -> Iterator[Harness]:
    """ADS on loopback, the MigrationControl server on a unix socket, ticking every 50 ms."""
    plane = XdsControlPlane("spine-gateway", {"layered": [Endpoint("127.0.0.1", 1)],
                                              "spine": [Endpoint("127.0.0.1", 2)]})
    ads = plane.start("127.0.0.1:0")
    metrics = ScrapeSource({"layered": [metrics_url], "spine": [metrics_url]}, interval_s=None)
    target = XdsTarget(plane, metrics, min_data_planes=0, min_spine_replicas=min_spine)
    listen = f"unix:{tmp / 'controller.sock'}"
    process = ControllerProcess(str(tmp / "rollout.db"), listen, TOKEN, target, tick_s=0.05)
    target.serve_stable()
    process.start()
    channel = grpc.insecure_channel(listen)
    try:
        yield Harness(migration_pb2_grpc.MigrationControlStub(channel), ads, plane, listen)
    finally:
        channel.close()
        process.stop()
        target.close()


def follower_row(status: migration_pb2.RolloutStatus, node_id: str) -> migration_pb2.Follower | None:
    return next((f for f in status.followers if f.node_id == node_id), None)


# -- rate limiters joining and leaving ------------------------------------------------------

def admitted_directly(servicer: Any, tenant: str, asks: int) -> int:
    items = [ratelimit_pb2.AdmitRequest(tenant=tenant, model="tiny-lm", tokens=8) for _ in range(asks)]
    return sum(r.response.admitted for r in servicer.AdmitBatch(ratelimit_pb2.AdmitBatchRequest(items=items)).results)


def test_rate_limiters_get_their_share_at_once_when_they_join_late_or_one_leaves(tmp_path: Path) -> None:
    config = config_for_tests()
    limiters = {name: DEFAULT["ratelimit"].build(config, DeviceContext.for_section(config.device), tmp_path) for name in
                ("rl-1", "rl-2", "rl-3")}
    followers: dict[str, StageFollower] = {}

    def join(name: str, ads: str) -> StageFollower:
        followers[name] = StageFollower(ads, name, ROLE_LAYERED_RATELIMIT, ratelimit_applier(limiters[name])).start()
        return followers[name]

    with controller(tmp_path, "http://127.0.0.1:9/metrics", min_spine=0) as harness:
        try:
            for name in ("rl-1", "rl-2"):
                assert join(name, harness.ads).wait_applied(15)
            # Before any rollout the spine calls no limiter of its own: the layered ones share it all.
            eventually(lambda: all(f.state()["ratelimit_share"] == 0.5 for f in followers.values()), what="1/2 each")
            harness.start(plan_yaml("split", {"name": "half", "spine_weight": 50, "placements": LOCAL}))
            status = eventually(harness.applied, what="the stage applied by both limiters")
            assert {f.node_id: round(f.ratelimit_share, 4) for f in status.followers} == {"rl-1": 0.25, "rl-2": 0.25}
            assert all(f.acked_version == status.version for f in status.followers)
            # 0.5 (the layered side at 50 %) / 2 limiters: 5 of a burst of 20 each, exactly.
            assert [admitted_directly(limiters[n], "split-local", 30) for n in ("rl-1", "rl-2")] == [5, 5]

            late = join("rl-3", harness.ads)
            assert late.wait_applied(15)
            # The late one gets the current stage at once, already counted in: 0.5 / 3.
            assert late.applied_version == f"{status.version}+m1"
            assert late.state()["ratelimit_share"] == pytest.approx(0.5 / 3)
            eventually(lambda: all(f.applied_version == f"{status.version}+m1" for f in followers.values()),
                     what="every limiter republished at 1/3")
            plane = harness.plane
            assert plane is not None and eventually(lambda: plane.followers_applied(status.version))
            assert admitted_directly(limiters["rl-3"], "split-remote", 30) == 3  # floor(20 / 6)

            followers.pop("rl-1").stop()
            eventually(lambda: all(f.applied_version == f"{status.version}+m2" for f in followers.values()),
                     what="the two left republished")
            assert all(f.state()["ratelimit_share"] == 0.25 for f in followers.values())
            eventually(lambda: {f.node_id for f in harness.status().followers} == {"rl-2", "rl-3"},
                     what="rl-1 gone from the status")
            assert harness.status().applied  # a stage once applied stays applied while followers come and go
        finally:
            for follower in followers.values():
                follower.stop()


# -- a spine that cannot apply a stage -------------------------------------------------------

def test_a_spine_that_cannot_apply_a_stage_nacks_it_and_the_stage_is_not_applied(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    config = config_for_tests()
    with contextlib.ExitStack() as teardown:
        stack = Stack(config, placements_for("collapsed", config), run_dir=tmp_path / "spine").start()
        teardown.callback(stack.stop)
        harness = teardown.enter_context(controller(tmp_path, f"http://{stack.metrics_address()}/metrics",
                                                    min_spine=1))
        follower = StageFollower(harness.ads, "spine-a", ROLE_SPINE, spine_applier(stack)).start()
        teardown.callback(follower.stop)
        assert follower.wait_applied(15)  # the stable state: keep your own placements
        assert stack.layout == "collapsed"
        # The controller records the ACK of the stable state (republished as "+m1" when the spine
        # joined) before the stage starts: an ACK that crosses a newer version is stale and dropped.
        eventually(lambda: getattr(follower_row(harness.status(), "spine-a"), "acked_version", "") == "stable+m1",
                 what="the stable state's ACK in the status")
        # This spine has no auth process to call: it cannot place auth remote.
        started = harness.start(plan_yaml(
            "nack", {"name": "auth-remote", "spine_weight": 10, "placements": {**LOCAL, "auth": "remote"}},
            {"name": "all-local", "spine_weight": 10, "placements": LOCAL}))

        def refused() -> migration_pb2.Follower | None:
            row = follower_row(harness.status(), "spine-a")
            return row if row is not None and row.nack_error else None

        row = eventually(refused, what="the NACK in the status")
        # It keeps what it had: the stable state, republished when it joined ("+m1").
        assert row.nacked_version == started.version and row.acked_version == "stable+m1"
        assert "placements.auth" in row.nack_error and "remote_addresses.auth" in row.nack_error
        assert stack.placements["auth"] == "local" and stack.layout == "collapsed"  # nothing moved
        status = harness.status()
        assert not status.applied and status.state == "progressing" and status.stage_name == "auth-remote"
        assert harness.plane is not None and not harness.plane.followers_applied(started.version, 1)
        # What an operator sees: `spine migrate status`, as JSON and as a table.
        monkeypatch.setenv("SPINE_ADMIN_TOKEN", TOKEN)
        capsys.readouterr()
        assert migrate(["migrate", "status", "--controller", harness.listen, "--json"]) == 0
        (shown,) = json.loads(capsys.readouterr().out)["followers"]
        assert (shown["node_id"], shown["role"], shown["nacked_version"]) == ("spine-a", "spine", started.version)
        assert migrate(["migrate", "status", "--controller", harness.listen]) == 0
        table = capsys.readouterr().out
        assert "stage followers: 0 of 1 applied" in table and "spine-a" in table and f"{started.version}:" in table

        harness.stub.Advance(migration_pb2.AdvanceRequest(stage="all-local", actor="test"), metadata=MD, timeout=10)
        status = eventually(harness.applied, what="the next stage applied")
        row = follower_row(status, "spine-a")
        assert row is not None and row.acked_version == status.version and not row.nack_error
        assert dict(row.placements) == LOCAL


# -- spine up follows, placements move, a rollback returns them with the weights -------------

def layout_served(address: str) -> str:
    with grpc.insecure_channel(address) as channel:
        _, call = gateway_pb2_grpc.GatewayStub(channel).Generate.with_call(
            generation_pb2.GenerateRequest(model="tiny-lm", prompt="which layout", max_tokens=1),
            metadata=[("authorization", f"Bearer {DEV_KEY}")], timeout=30)
        return str(dict(call.trailing_metadata())["x-spine-layout"])


def test_spine_up_follows_the_stages_placements_and_a_rollback_returns_them_with_the_weights(tmp_path: Path) -> None:
    sock_dir = Path(tempfile.mkdtemp(prefix="spine-follow-", dir="/tmp"))
    processes: list[Launched] = []  # each one's log beside it in tmp_path: read them when this test fails
    try:
        logs_address = f"unix:{sock_dir}/logs.sock"
        spine_port, metrics_port, ads = free_port(), free_port(), f"127.0.0.1:{free_port()}"
        config = config_for_tests(remote_addresses={"logs": logs_address},
                                  metrics={"http_listen": f"127.0.0.1:{metrics_port}"})
        config_file = tmp_path / "config.yaml"
        config_file.write_text(config.to_yaml())
        processes.append(launch("logs", [sys.executable, "-m", "runtime.process", "logs", "--listen", logs_address,
                                         "--config", str(config_file), "--run-dir", str(tmp_path / "logs")],
                                log_path=tmp_path / "logs.log"))
        token_file = tmp_path / "token"
        token_file.write_text(TOKEN)
        token_file.chmod(0o600)
        listen = f"unix:{sock_dir}/controller.sock"
        metrics = f"http://127.0.0.1:{metrics_port}/metrics"
        spine = f"127.0.0.1:{spine_port}"
        processes.append(launch("controller", [
            sys.executable, "-m", "migration.runner", "--db", str(tmp_path / "rollout.db"), "--listen", listen,
            "--admin-token-file", str(token_file), "--target", "xds", "--xds-listen", ads, "--layered", spine,
            "--spine", spine, "--layered-metrics", metrics, "--spine-metrics", metrics,
            "--min-data-planes", "0", "--min-spine-replicas", "1"], log_path=tmp_path / "controller.log"))
        assert wait_serving(listen, timeout=60) and wait_serving(logs_address, timeout=60)
        up = launch("spine", spine_up_argv(config_file, "collapsed", listen=spine, http_listen="127.0.0.1:0",
                                           run_dir=tmp_path / "spine",
                                           extra=("--follow-controller", ads, "--node-id", "spine-a")),
                    log_path=tmp_path / "spine.log")
        processes.append(up)
        ready = up.wait_ready(90)
        # Before any rollout: the stable state (republished as it joined), its own placements kept.
        assert ready["follower"]["applied_version"] == "stable+m1" and ready["layout"] == "collapsed"

        with grpc.insecure_channel(listen) as channel:
            harness = Harness(migration_pb2_grpc.MigrationControlStub(channel), ads)
            assert harness.status().min_spine_replicas == 1
            harness.start(plan_yaml("follow", {"name": "logs-remote", "spine_weight": 10,
                                               "placements": {**LOCAL, "logs": "remote"}},
                                    {"name": "all-local", "spine_weight": 20, "placements": {"logs": "local"}}))
            status = eventually(harness.applied, what="stage 1 applied by the spine")
            row = follower_row(status, "spine-a")
            assert row is not None and row.role == "spine" and row.acked_version == status.version
            assert row.placements["logs"] == "remote" and layout_served(spine) == "mixed"

            harness.stub.Advance(migration_pb2.AdvanceRequest(actor="test"), metadata=MD, timeout=10)
            status = eventually(harness.applied, what="stage 2 applied by the spine")
            assert status.stage_name == "all-local" and layout_served(spine) == "collapsed"

            harness.stub.Rollback(migration_pb2.CommandRequest(actor="test", reason="test"), metadata=MD, timeout=10)
            status = eventually(lambda: (s := harness.status()).state == "rolled_back" and s, what="rolled back")
            assert status.spine_weight == 0 and status.placements["logs"] == "remote"
            row = follower_row(status, "spine-a")
            assert row is not None and row.acked_version == status.version and row.placements["logs"] == "remote"
            assert layout_served(spine) == "mixed"  # the previous stage's placements, with 0 % of the traffic
    finally:
        for process in reversed(processes):
            process.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)


# -- limits that hold across two spines and two layered rate limiters ------------------------

def spine_ask(channel: grpc.Channel, key: str) -> Callable[[int], bool]:
    """One request through a spine's gateway: admitted (OK) or over the limit."""
    stub = gateway_pb2_grpc.GatewayStub(channel)

    def ask(i: int) -> bool:
        try:
            stub.Generate(generation_pb2.GenerateRequest(model="tiny-lm", prompt=f"p{i}", max_tokens=1),
                          metadata=[("authorization", f"Bearer {key}")], timeout=30)
            return True
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
            return False

    return ask


def layered_ask(channel: grpc.Channel, tenant: str) -> Callable[[int], bool]:
    """What a layered gateway asks its rate limiter per request (same tenant, model and cost)."""
    stub = ratelimit_pb2_grpc.RateLimitStub(channel)

    def ask(i: int) -> bool:
        request = ratelimit_pb2.AdmitRequest(tenant=tenant, model="tiny-lm", tokens=len(f"p{i}".encode()) + 1)
        return bool(one(stub.AdmitBatch(ratelimit_pb2.AdmitBatchRequest(items=[request]), timeout=10)).admitted)

    return ask


def admitted_everywhere(spines: list[RunningStack], limiters: list[str], key: str, tenant: str, per_entry: int) -> list[int]:
    """`per_entry` requests of one tenant into each of the four entry points, interleaved."""
    channels = [grpc.insecure_channel(address) for address in [*(s.address for s in spines), *limiters]]
    try:
        asks = [spine_ask(c, key) for c in channels[:len(spines)]] + \
               [layered_ask(c, tenant) for c in channels[len(spines):]]
        counts = [0] * len(asks)
        for i in range(per_entry):
            for index, ask in enumerate(asks):
                counts[index] += ask(i)
        return counts
    finally:
        for channel in channels:
            channel.close()


def test_a_tenant_gets_at_most_its_limit_across_two_spines_and_two_layered_rate_limiters(tmp_path: Path) -> None:
    """Two spine replicas (real stacks, each following) and two layered rate limiters (real
    processes, each following), one tenant asking 30 times at each of the four: the total
    admitted stays within its limit of 20, first while the spines still call the layered
    limiters, then with each side enforcing its own share. Without shares it would be 80."""
    base = config_for_tests()
    config_file = tmp_path / "config.yaml"
    config_file.write_text(base.to_yaml())
    with contextlib.ExitStack() as teardown:  # unwinds followers, stacks, processes, then the controller
        sock_dir = Path(tempfile.mkdtemp(prefix="spine-limits-", dir="/tmp"))
        teardown.callback(shutil.rmtree, sock_dir, ignore_errors=True)
        harness = teardown.enter_context(controller(tmp_path, "http://127.0.0.1:9/metrics", min_spine=2))
        limiters = [f"unix:{sock_dir}/rl-{i}.sock" for i in (1, 2)]
        for i, address in enumerate(limiters, start=1):
            process = launch(f"rl-{i}", [
                sys.executable, "-m", "runtime.process", "ratelimit", "--listen", address, "--config",
                str(config_file), "--run-dir", str(tmp_path / f"rl-{i}"), "--follow-controller", harness.ads,
                "--node-id", f"layered-rl-{i}"], log_path=tmp_path / f"rl-{i}.log")  # read it when this fails
            teardown.callback(process.stop)
        spines = []
        for i, address in enumerate(limiters, start=1):  # each spine reaches one layered limiter
            stack = Stack(base, placements_for("collapsed", base), run_dir=tmp_path / f"spine-{i}",
                          remote_addresses={"ratelimit": address}).start()
            teardown.callback(stack.stop)
            spines.append(stack)
            teardown.callback(StageFollower(harness.ads, f"spine-{i}", ROLE_SPINE, spine_applier(stack)).start().stop)
        assert all(wait_serving(address, timeout=60) for address in limiters)
        harness.start(plan_yaml("limits", {"name": "shared-limiter", "spine_weight": 50,
                                           "placements": {**LOCAL, "ratelimit": "remote"}},
                                {"name": "own-limiter", "spine_weight": 50, "placements": {"ratelimit": "local"}}))
        status = eventually(harness.applied, what="stage 1 applied by 2 spines and 2 limiters")
        shares = {f.node_id: round(f.ratelimit_share, 4) for f in status.followers}
        # The spines call the layered limiters, which hold the whole limit between them.
        assert shares == {"spine-1": 0, "spine-2": 0, "layered-rl-1": 0.5, "layered-rl-2": 0.5}
        assert all(s.placements["ratelimit"] == "remote" for s in spines)
        shared = admitted_everywhere(spines, limiters, SPLIT_KEYS["remote"], "split-remote", 30)

        harness.stub.Advance(migration_pb2.AdvanceRequest(actor="test"), metadata=MD, timeout=10)
        status = eventually(lambda: (s := harness.applied()) and s.stage_name == "own-limiter" and s,
                          what="stage 2 applied")
        shares = {f.node_id: round(f.ratelimit_share, 4) for f in status.followers}
        # Each side holds its weight's share (50 %), split over its two replicas.
        assert shares == {"spine-1": 0.25, "spine-2": 0.25, "layered-rl-1": 0.25, "layered-rl-2": 0.25}
        assert all(s.placements["ratelimit"] == "local" for s in spines)
        own = admitted_everywhere(spines, limiters, SPLIT_KEYS["local"], "split-local", 30)
    print(f"\nadmitted of {4 * 30} asks (limit {LIMIT}): spines calling the layered limiters {shared} = "
          f"{sum(shared)}; each side its own {own} = {sum(own)}")
    for counts in (shared, own):
        assert LIMIT * 0.9 <= sum(counts) <= LIMIT * 1.05, counts
    assert own == [5, 5, 5, 5]  # a quarter each: nobody holds the whole limit any more
