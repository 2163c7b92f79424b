"""The controller process: SIGKILL mid-stage, restart, and the same stage resumes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from migration.recording import RecordingTarget
from migration.testing import ADMIN_TOKEN
from runtime.processes.parent import spawn
from wire.v1 import migration_pb2 as pb
from wire.v1 import migration_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
AUTH = (("authorization", f"Bearer {ADMIN_TOKEN}"),)
LONG_PLAN = textwrap.dedent("""\
    name: long
    window_s: 5
    stages:
      - {name: canary, spine_weight: 5, placements: {logs: local}, hold_s: 3600}
      - {name: quarter, spine_weight: 25, placements: {cache: local, metrics: local}, hold_s: 3600}
      - {name: full, spine_weight: 100, placements: {auth: local}, hold_s: 3600}
    """)


class Runner:
    def __init__(self, workdir: Path, sockets: str) -> None:
        self.token_file = workdir / "token"
        self.token_file.write_text(ADMIN_TOKEN + "\n")
        self.token_file.chmod(0o600)
        self.token_file.chmod(0o600)
        self.applies = workdir / "applies.jsonl"
        self.listen = f"unix:{sockets}/c.sock"
        self.args = [sys.executable, "-m", "migration.runner", "--db", str(workdir / "m.db"), "--listen",
                     self.listen, "--admin-token-file", str(self.token_file), "--target", "recording",
                     "--recording-file", str(self.applies), "--tick-s", "0.05"]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> pb_grpc.MigrationControlStub:
        env = {k: v for k, v in os.environ.items() if k != "SPINE_ADMIN_TOKEN"}
        self.proc = spawn(self.args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        # Its own subchannel pool and a short backoff: a channel to the killed controller's
        # socket must not hand its growing reconnect backoff to this one (seen in CI).
        channel = grpc.insecure_channel(self.listen, options=[
            ("grpc.use_local_subchannel_pool", 1),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 500),
        ])
        try:
            grpc.channel_ready_future(channel).result(timeout=30)
        except grpc.FutureTimeoutError:
            self.proc.kill()
            raise AssertionError(f"controller did not come up: {self.proc.communicate()[1].decode()}") from None
        return pb_grpc.MigrationControlStub(channel)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture
def runner(tmp_path) -> Iterator[Runner]:
    sockets = tempfile.mkdtemp(prefix="mig", dir="/tmp")
    runner = Runner(tmp_path, sockets)
    try:
        yield runner
    finally:
        runner.stop()
        shutil.rmtree(sockets, ignore_errors=True)


def test_after_sigkill_mid_stage_a_restart_resumes_the_same_stage_with_the_same_weights(runner):
    control = runner.start()
    control.Start(pb.StartRequest(plan_yaml=LONG_PLAN, actor="erin"), metadata=AUTH, timeout=10)
    control.Advance(pb.AdvanceRequest(stage="quarter", actor="erin"), metadata=AUTH, timeout=10)
    before = control.Status(pb.StatusRequest(), metadata=AUTH, timeout=10)
    assert (before.state, before.stage_name, before.spine_weight) == ("progressing", "quarter", 25.0)

    assert runner.proc is not None
    runner.proc.send_signal(signal.SIGKILL)
    assert runner.proc.wait(timeout=10) == -signal.SIGKILL

    control = runner.start()
    after = control.Status(pb.StatusRequest(), metadata=AUTH, timeout=10)
    assert (after.state, after.stage_name, after.stage_index, after.spine_weight) == ("progressing", "quarter", 1, 25.0)
    assert dict(after.placements) == dict(before.placements)
    assert after.version != before.version  # re-applied under a new version
    assert after.stage_elapsed_s >= before.stage_elapsed_s  # the hold continues, it does not restart
    assert after.recent_audit[-1].action == "recover"

    applies = RecordingTarget.read_applies(runner.applies)
    assert [a.spine_weight for a in applies] == [5.0, 25.0, 25.0]
    assert applies[-1].placements == applies[-2].placements == dict(before.placements)
    assert applies[-1].version == after.version


def test_sigterm_stops_the_controller_cleanly(runner):
    runner.start()
    assert runner.proc is not None
    runner.proc.send_signal(signal.SIGTERM)
    assert runner.proc.wait(timeout=15) == 0
    assert not Path(runner.listen.removeprefix("unix:")).exists()


def test_the_runner_refuses_to_start_without_a_token(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "SPINE_ADMIN_TOKEN"}
    done = subprocess.run([sys.executable, "-m", "migration.runner", "--db", str(tmp_path / "m.db"),
                           "--listen", "unix:/tmp/never-bound.sock", "--target", "recording"], cwd=ROOT, env=env,
                          capture_output=True, timeout=60)
    assert done.returncode == 2 and b"no admin token" in done.stderr


def test_the_runner_without_a_target_exits_2_naming_the_choices(tmp_path):
    done = subprocess.run([sys.executable, "-m", "migration.runner", "--db", str(tmp_path / "m.db"),
                           "--listen", "unix:/tmp/never-bound.sock"], cwd=ROOT, capture_output=True, timeout=60)
    assert done.returncode == 2 and b"--target" in done.stderr and b"recording" in done.stderr
