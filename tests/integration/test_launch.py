"""The one launcher (`runtime.processes.launch`): a ready line found past other output, a failure said
with the log's tail, stdin lines answered, and a stop that leaves no process of the tree."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from runtime.processes.launch import READY, LaunchFailed, launch, serving_on

SLEEP = "import time; time.sleep(60)"

def test_the_ready_event_is_found_after_other_lines(tmp_path: Path) -> None:
    child = launch("child", [sys.executable, "-c", 'print("starting"); print("[1, 2]"); '
                             'print(\'{"event": "ready", "address": "unix:/x"}\', flush=True); ' + SLEEP],
                   log_path=tmp_path / "child.log")
    try:
        assert child.wait_ready(30) == {"event": "ready", "address": "unix:/x"}
    finally:
        child.stop(5)

def test_a_serving_on_line_is_a_ready_event(tmp_path: Path) -> None:
    child = launch("child", [sys.executable, "-c", 'print("inference serving on unix:/y", flush=True); ' + SLEEP],
                   log_path=tmp_path / "child.log")
    try:
        assert child.wait_ready(30, serving_on)["address"] == "unix:/y"
    finally:
        child.stop(5)

def test_a_failed_event_raises_with_its_error_and_stops_the_child(tmp_path: Path) -> None:
    child = launch("child", [sys.executable, "-c", 'print(\'{"event": "failed", "error": "no model"}\', flush=True); '
                             + SLEEP], log_path=tmp_path / "child.log")
    with pytest.raises(LaunchFailed, match="no model"):
        child.wait_ready(30)
    assert not child.alive()

def test_an_exit_before_the_ready_line_raises_with_the_log_tail(tmp_path: Path) -> None:
    child = launch("child", [sys.executable, "-c", 'import sys; print("the reason", file=sys.stderr); sys.exit(2)'],
                   log_path=tmp_path / "child.log")
    with pytest.raises(LaunchFailed, match=r"exited with code 2(.|\n)*the reason"):
        child.wait_ready(30)

def test_a_silent_child_is_stopped_at_the_deadline(tmp_path: Path) -> None:
    child = launch("child", [sys.executable, "-c", SLEEP], log_path=tmp_path / "child.log")
    with pytest.raises(LaunchFailed, match="did not come up"):
        child.wait_ready(0.5, READY)
    assert not child.alive()

def test_stdin_lines_are_answered_and_stdout_is_copied_to_a_file(tmp_path: Path) -> None:
    echo = "import sys\nfor line in sys.stdin:\n    print('got ' + line.strip(), flush=True)\n"
    child = launch("echo", [sys.executable, "-c", echo], log_path=tmp_path / "echo.log",
                   out_path=tmp_path / "echo.out", stdin=True)
    try:
        child.send("one")
        assert child.wait_for(lambda line: {"line": line} if line.startswith("got") else None, 30) == {"line": "got one"}
    finally:
        child.stop(5)
    assert (tmp_path / "echo.out").read_text() == "got one\n"

def test_stop_reaps_a_grandchild_that_outlives_the_root(tmp_path: Path) -> None:
    """The root ignores SIGTERM's meaning for its child: it exits and leaves a grandchild
    behind (in its session); the launcher stops it by the PID it remembered at ready."""
    code = ("import json, subprocess, sys, time\n"
            "grandchild = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "print(json.dumps({'event': 'ready', 'address': 'x', 'grandchild': grandchild.pid}), flush=True)\n"
            "time.sleep(60)\n")
    child = launch("root", [sys.executable, "-c", code], log_path=tmp_path / "root.log")
    ready = child.wait_ready(30)
    assert ready["grandchild"] in child.alive_pids()
    child.stop(5)
    assert child.alive_pids() == []
