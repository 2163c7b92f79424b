"""`spine migrate status --watch` read as a person sees it: through a pseudo-terminal."""

from __future__ import annotations

import os
import pty
import re
import select
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from migration.gates import WindowStats
from migration.plan import load_plan
from migration.recording import RecordingTarget
from migration.server import ControllerProcess
from migration.testing import ADMIN_TOKEN, HEALTHY

ROOT = Path(__file__).resolve().parents[2]
PLAN = textwrap.dedent("""\
    name: watched
    window_s: 0.2
    min_window_requests: 5
    stages:
      - {name: canary-logs, spine_weight: 10, placements: {logs: local}, hold_s: 1,
         gates: [{type: error_rate, max_delta: 0.01}]}
      - {name: half, spine_weight: 50, placements: {cache: local}, hold_s: 1,
         gates: [{type: error_rate, max_delta: 0.01}]}
      - {name: everything, spine_weight: 100, placements: {auth: local}, hold_s: 1}
    """)
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.fixture
def controller(tmp_path) -> Iterator[tuple[ControllerProcess, RecordingTarget]]:
    sockets = tempfile.mkdtemp(prefix="watch", dir="/tmp")
    target = RecordingTarget(layered=HEALTHY, spine=HEALTHY)
    process = ControllerProcess(str(tmp_path / "m.db"), f"unix:{sockets}/c.sock", ADMIN_TOKEN, target, tick_s=0.02)
    process.service._heartbeat_s = 0.2
    process.start()
    try:
        yield process, target
    finally:
        process.stop(grace=0.2)
        shutil.rmtree(sockets, ignore_errors=True)


def watch_in_a_terminal(process: ControllerProcess, act) -> tuple[int, str]:
    """Run `--watch` on a pseudo-terminal; call `act(screen so far)` as output comes; the
    exit code and everything the terminal showed (escape sequences removed)."""
    leader, follower = pty.openpty()
    env = {**os.environ, "SPINE_ADMIN_TOKEN": ADMIN_TOKEN, "TERM": "xterm-256color", "COLUMNS": "160",
           "LINES": "60", "PYTHONPATH": str(ROOT)}
    env.pop("NO_COLOR", None)
    child = subprocess.Popen([sys.executable, "-m", "spine.cli.migrate", "migrate", "status", "--watch",
                              "--controller", process.listen], stdin=follower, stdout=follower, stderr=follower,
                             env=env, cwd=ROOT, close_fds=True)
    os.close(follower)
    seen = b""
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                seen += chunk
                act(ANSI.sub("", seen.decode(errors="replace")))
            elif child.poll() is not None:
                break
        code = child.wait(timeout=10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        os.close(leader)
    return code, ANSI.sub("", seen.decode(errors="replace"))


def test_watch_redraws_each_stage_and_exits_0_when_promoted(controller):
    process, _ = controller
    started = []

    def act(screen: str) -> None:
        if not started and "watching" in screen:  # the view is up: now the rollout begins
            started.append(True)
            process.controller.start(load_plan(PLAN), "test")

    code, screen = watch_in_a_terminal(process, act)
    assert code == 0
    assert all(f"{n}/3 {name}" in screen for n, name in ((1, "canary-logs"), (2, "half"), (3, "everything")))
    assert "spine 100%" in screen and "error_rate" in screen and "threshold" in screen
    assert "finished: promoted" in screen


def test_watch_exits_1_when_the_rollout_is_rolled_back(controller):
    process, target = controller
    started = []

    def act(screen: str) -> None:
        if not started and "watching" in screen:
            started.append(True)
            process.controller.start(load_plan(PLAN), "test")
        elif started and "1/3 canary-logs" in screen:  # seen in its first stage: now the spine fails
            target.spine = WindowStats(requests=100, errors=50, p99_ms=10.0)

    code, screen = watch_in_a_terminal(process, act)
    assert code == 1
    assert "finished: rolled_back" in screen and "3/3 everything" not in screen
