"""Two controller processes on one PostgreSQL: one leads, the other takes over when it dies
(kill -9) or stalls (SIGSTOP past its lease), and a restarted PostgreSQL loses nothing.

Each replica is `python -m migration.runner` with a recording target (every weight it pushes
is appended to its own file: what would reach the xDS followers or the front) and short
lease settings (LEASE_S) so that a takeover takes a second, not fifteen.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from migration.plan import load_plan
from migration.recording import RecordingTarget
from migration.testing import ADMIN_TOKEN
from migration.xds.snapshot import ROUTE
from runtime.processes.parent import spawn
from runtime.server import free_port
from spine.tools.local_postgres import LocalPostgres
from tests.postgres_server import fresh_database, postgres, start_postgres  # noqa: F401 - the fixture
from tests.waiting import eventually
from tests.webhook_receiver import Receiver
from wire.v1 import migration_pb2 as pb
from wire.v1 import migration_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
AUTH = (("authorization", f"Bearer {ADMIN_TOKEN}"),)
DEMO = (ROOT / "deploy/plans/demo.yaml").read_text()
DEMO_WEIGHTS = [stage.spine_weight for stage in load_plan(DEMO).stages]  # one per stage, all different
LEASE_S, RENEW_S, RETRY_S = 1.0, 0.6, 0.15
LONG = """\
name: long
window_s: 0.5
stages:
  - {name: canary, spine_weight: 5, hold_s: 3600}
  - {name: quarter, spine_weight: 25, placements: {cache: local}, hold_s: 3600}
  - {name: full, spine_weight: 100, hold_s: 3600}
"""


class Replica:
    def __init__(self, name: str, workdir: Path, sockets: Path, dsn_file: Path, webhook: str,
                 xds: bool = False) -> None:
        self.name = name
        self.applies = workdir / f"{name}.jsonl"
        self.log = workdir / f"{name}.log"
        self.listen = f"unix:{sockets}/{name}.sock"
        self.dashboard = f"127.0.0.1:{free_port()}"
        self.xds = f"127.0.0.1:{free_port()}" if xds else ""
        token = workdir / "token"
        token.write_text(ADMIN_TOKEN + "\n")
        token.chmod(0o600)
        secret = workdir / "webhook-secret"
        secret.write_text("webhook-secret-0123456789abcdef\n")
        secret.chmod(0o600)
        self.args = [sys.executable, "-m", "migration.runner", "--db-dsn-file", str(dsn_file), "--listen",
                     self.listen, "--admin-token-file", str(token), "--target", "recording",
                     "--recording-file", str(self.applies), "--tick-s", "0.05", "--controller-id", name,
                     "--lease-duration-s", str(LEASE_S), "--lease-renew-deadline-s", str(RENEW_S),
                     "--lease-retry-period-s", str(RETRY_S), "--webhook-url", webhook,
                     "--webhook-secret-file", str(secret), "--dashboard-listen", self.dashboard]
        if xds:  # stages over ADS; no gateway or metrics behind these addresses (no gate judges here)
            nowhere = f"127.0.0.1:{free_port()}"
            target = self.args.index("recording")
            self.args[target - 1:target + 3] = [
                "--target", "xds", "--xds-listen", self.xds, "--layered", nowhere, "--spine", nowhere,
                "--layered-metrics", f"http://{nowhere}/metrics", "--spine-metrics", f"http://{nowhere}/metrics",
                "--min-data-planes", "0", "--min-spine-replicas", "0"]
        self.proc: subprocess.Popen[bytes] | None = None
        self.control: pb_grpc.MigrationControlStub | None = None

    def start(self) -> Replica:
        env = {k: v for k, v in os.environ.items() if k != "SPINE_ADMIN_TOKEN"}
        with self.log.open("ab") as log:
            self.proc = spawn(self.args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log)
        channel = grpc.insecure_channel(self.listen, options=[("grpc.use_local_subchannel_pool", 1)])
        try:
            grpc.channel_ready_future(channel).result(timeout=30)
        except grpc.FutureTimeoutError:
            self.stop()
            raise AssertionError(f"{self.name} did not come up: {self.log.read_text()[-2000:]}") from None
        self.control = pb_grpc.MigrationControlStub(channel)
        return self

    def status(self) -> pb.RolloutStatus:
        assert self.control is not None
        return self.control.Status(pb.StatusRequest(audit_rows=100), metadata=AUTH, timeout=10)

    def leads(self) -> bool:
        try:
            return self.status().leadership.leading
        except grpc.RpcError:
            return False

    def weights(self) -> list[float]:
        return [applied.spine_weight for applied in RecordingTarget.read_applies(self.applies)]

    def press(self, command: str) -> tuple[int, dict[str, object]]:
        """A dashboard button, as an operator's browser presses it: (HTTP status, JSON body)."""
        request = urllib.request.Request(f"http://{self.dashboard}/api/commands/{command}", method="POST",
                                         data=json.dumps({"actor": "erin"}).encode(),
                                         headers={"Authorization": f"Bearer {ADMIN_TOKEN}",
                                                  "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    def signal(self, signum: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signum)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    receiver = Receiver()
    try:
        yield receiver
    finally:
        receiver.stop()


@pytest.fixture
def pair(postgres, tmp_path, receiver) -> Iterator[tuple[Replica, Replica]]:  # noqa: F811 - the imported fixture
    with replicas_on(postgres, tmp_path, receiver.url) as replicas:
        yield replicas


@contextmanager
def replicas_on(server: LocalPostgres, workdir: Path, webhook: str,
                xds: bool = False) -> Iterator[tuple[Replica, Replica]]:
    sockets = Path(tempfile.mkdtemp(prefix="rep", dir="/tmp"))
    dsn_file = workdir / "dsn"
    dsn_file.write_text(fresh_database(server, "replicas") + "\n")
    dsn_file.chmod(0o600)
    replicas = (Replica("r1", workdir, sockets, dsn_file, webhook, xds),
                Replica("r2", workdir, sockets, dsn_file, webhook, xds))
    try:
        for replica in replicas:
            replica.start()
        yield replicas
    finally:
        for replica in replicas:
            replica.stop()
        shutil.rmtree(sockets, ignore_errors=True)


def leader_of(replicas: tuple[Replica, ...]) -> tuple[Replica, Replica]:
    """(leader, the other), once one leads."""
    leader = eventually(lambda: next((r for r in replicas if r.leads()), None), timeout=30, what="a leader")
    return leader, next(r for r in replicas if r is not leader)


def stage_entries(status: pb.RolloutStatus) -> list[str]:
    """The stages the audit trail entered, in order (start, advance, promote)."""
    return [row.stage for row in status.recent_audit if row.action in ("start", "advance")]


def test_when_the_leader_is_killed_mid_stage_the_other_resumes_the_same_stage(pair):
    leader, other = leader_of(pair)
    assert other.status().leadership.leader == leader.name
    leader.control.Start(pb.StartRequest(plan_yaml=DEMO, actor="erin"), metadata=AUTH, timeout=10)
    killed_at = eventually(lambda: (s := leader.status()).stage_name == "cache-router-local" and s,
                           timeout=60, what="the demo reaches its second stage")
    epoch = killed_at.leadership.epoch

    leader.signal(signal.SIGKILL)
    t0 = time.monotonic()
    # The stage it was killed in: the last weight it pushed (it may have moved on since the
    # status was read, on a slow machine).
    weights = DEMO_WEIGHTS
    killed_in = weights.index(leader.weights()[-1])
    eventually(other.leads, timeout=30, what=f"{other.name} takes over")
    print(f"takeover after kill -9: {time.monotonic() - t0:.2f} s (lease {LEASE_S} s + retry {RETRY_S} s)")

    final = eventually(lambda: (s := other.status()).state == "promoted" and s, timeout=60,
                       what="the demo promoted by the new leader")
    assert final.leadership.epoch == epoch + 1 and final.leadership.leader == other.name
    assert stage_entries(final) == list(final.stage_names)  # each stage entered once, in order
    recovers = [row for row in final.recent_audit if row.action == "recover"]
    assert len(recovers) == 1 and recovers[0].stage == final.stage_names[killed_in]
    assert f"{other.name} took over as leader (lease epoch {epoch + 1})" in recovers[0].reason
    ids = [row.id for row in final.recent_audit]
    assert ids == list(range(ids[0], ids[0] + len(ids)))  # no gap in the audit trail
    # The new leader pushed first the stage it took over (re-applied), then the ones after it.
    assert other.weights() == weights[killed_in:]


def test_a_leader_stopped_past_its_lease_writes_and_pushes_nothing_when_it_wakes(pair, receiver):
    leader, other = leader_of(pair)
    leader.control.Start(pb.StartRequest(plan_yaml=LONG, actor="erin"), metadata=AUTH, timeout=10)
    leader.control.Advance(pb.AdvanceRequest(stage="quarter", actor="erin"), metadata=AUTH, timeout=10)
    pushed = leader.weights()
    assert pushed == [5.0, 25.0]

    leader.signal(signal.SIGSTOP)
    eventually(other.leads, timeout=30, what=f"{other.name} takes over from the stopped {leader.name}")
    taken = other.status()
    leader.signal(signal.SIGCONT)

    refused = 0
    for call, request in ((leader.control.Pause, pb.CommandRequest(actor="erin")),
                          (leader.control.Advance, pb.AdvanceRequest(stage="full", actor="erin")),
                          (leader.control.Rollback, pb.CommandRequest(actor="erin")),
                          (leader.control.Abort, pb.CommandRequest(actor="erin"))):
        with pytest.raises(grpc.RpcError) as refusal:
            call(request, metadata=AUTH, timeout=10)
        assert refusal.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert other.name in refusal.value.details()  # it names the leader to send writes to
        refused += 1
    assert refused == 4
    # The dashboard's buttons run the command on the controller itself: there the store's fence
    # is what refuses it, and counts it.
    code, body = leader.press("pause")
    assert code == 409 and "write refused" in str(body["error"]) and other.name in str(body["error"])
    refused += 1

    woke = eventually(lambda: (s := leader.status()).leadership.leader == other.name and s, timeout=30,
                      what=f"{leader.name} sees {other.name} lead")
    assert not woke.leadership.leading and woke.leadership.epoch == taken.leadership.epoch
    assert leader.weights() == pushed  # nothing it computed after the stop reached the data path
    after = other.status()
    assert (after.state, after.stage_name) == ("progressing", "quarter")
    assert not [row for row in after.recent_audit if row.actor == "erin" and row.action != "start"
                and row.action != "advance"]
    assert other.weights() == [25.0]  # the new leader re-applied the stage it took over, nothing else
    # Webhooks: one per committed transition, whoever committed it; none for a refused one.
    committed = sorted(row.id for row in after.recent_audit)
    delivered = eventually(lambda: sorted({json.loads(body)["audit_id"] for _, body in receiver.received})
                           == committed and receiver.received, timeout=30, what="every committed transition notified",
                           seen=lambda: [json.loads(body)["audit_id"] for _, body in receiver.received])
    assert {json.loads(body)["action"] for _, body in delivered} == {"start", "advance", "recover"}
    fenced = leader.status().leadership.fenced_writes
    assert fenced >= 1 and leader.log.read_text().count("write refused:") == fenced  # each one logged
    print(f"writes refused by the woken leader: {refused} commands ({refused - 1} by the leader check, "
          f"1 by the fence); {fenced} by the fence in all")


def test_a_restarted_postgres_pauses_the_controllers_and_loses_nothing(tmp_path, receiver):
    server = start_postgres()
    try:
        with replicas_on(server, tmp_path, receiver.url) as replicas:
            leader, _ = leader_of(replicas)
            leader.control.Start(pb.StartRequest(plan_yaml=LONG, actor="erin"), metadata=AUTH, timeout=10)
            leader.control.Advance(pb.AdvanceRequest(stage="quarter", actor="erin"), metadata=AUTH, timeout=10)
            before = leader.status()

            server.stop()
            eventually(lambda: "no longer leading" in leader.log.read_text(), timeout=30,
                       what=f"{leader.name} gives up leading while the store is down")
            server.restart()

            leader, _ = leader_of(replicas)
            after = eventually(lambda: (s := leader.status()).recent_audit[-1].action == "recover" and s,
                               timeout=30, what="the new leader re-applies the recorded stage")
            assert (after.state, after.stage_name, after.spine_weight) == ("progressing", "quarter", 25.0)
            assert after.leadership.epoch > before.leadership.epoch
            kept = {row.id: (row.action, row.stage) for row in before.recent_audit}
            assert {row.id: (row.action, row.stage) for row in after.recent_audit if row.id in kept} == kept
            assert [row.action for row in after.recent_audit] == ["start", "advance", "recover"]
            leader.control.Advance(pb.AdvanceRequest(stage="full", actor="erin"), metadata=AUTH, timeout=10)
            assert leader.status().stage_name == "full"
    finally:
        server.remove()


class RouteWatcher:
    """A data plane's ADS stream for the route (the weights): every version it is sent, and
    how the stream ended."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.versions: list[str] = []
        self.ended: grpc.RpcError | None = None
        self._hang_up = threading.Event()
        request = discovery_pb2.DiscoveryRequest(type_url=ROUTE, resource_names=["spine-gateway-route"])
        request.node.id = f"envoy-{address}"

        def requests() -> Iterator[discovery_pb2.DiscoveryRequest]:
            yield request
            self._hang_up.wait(60)

        self.call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(self.channel).StreamAggregatedResources(requests())
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for response in self.call:
                self.versions.append(response.version_info)
        except grpc.RpcError as error:
            self.ended = error

    def close(self) -> None:
        self._hang_up.set()
        self.call.cancel()
        self.channel.close()


def test_only_the_leader_serves_xds_and_a_woken_old_leader_sends_its_data_planes_nothing(postgres, tmp_path,  # noqa: F811
                                                                                         receiver):
    with replicas_on(postgres, tmp_path, receiver.url, xds=True) as replicas:
        leader, other = leader_of(replicas)
        leader.control.Start(pb.StartRequest(plan_yaml=LONG, actor="erin"), metadata=AUTH, timeout=10)
        leader.control.Advance(pb.AdvanceRequest(stage="quarter", actor="erin"), metadata=AUTH, timeout=10)
        to_leader, to_other = RouteWatcher(leader.xds), RouteWatcher(other.xds)
        try:
            eventually(lambda: to_leader.versions == ["long#2"], timeout=10, what="the leader's stage reaches its data plane",
                       seen=lambda: to_leader.versions)
            eventually(lambda: to_other.ended is not None, timeout=10, what="the follower refuses ADS")
            assert to_other.ended.code() is grpc.StatusCode.UNAVAILABLE and "does not lead" in to_other.ended.details()

            leader.signal(signal.SIGSTOP)
            eventually(other.leads, timeout=30, what=f"{other.name} takes over")
            from_new = RouteWatcher(other.xds)
            eventually(lambda: from_new.versions == ["long#3"], timeout=10, what="the new leader serves its re-apply",
                       seen=lambda: from_new.versions)
            leader.signal(signal.SIGCONT)

            eventually(lambda: to_leader.ended is not None, timeout=30, what="the woken leader ends its streams")
            assert to_leader.ended.code() is grpc.StatusCode.UNAVAILABLE
            assert to_leader.versions == ["long#2"]  # nothing it computed after the stop reached its data plane
            from_new.close()
        finally:
            to_leader.close()
            to_other.close()
