"""A child that dies with the process that started it (`runtime.processes.parent`), started
without a fork hook: gRPC aborted children forked by a process with calls in flight."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from runtime.processes.parent import PARENT_PID_ENV, spawn
from tests.waiting import eventually

REPO_ROOT = Path(__file__).resolve().parents[2]
FOLLOW = "from runtime.processes.parent import follow_parent\n"
CHILD = FOLLOW + "import time\nif follow_parent():\n    time.sleep(60)\n"  # gone with its parent, either way


def _gone(pid: int) -> bool:
    """Whether process `pid` has exited (a zombie not yet reaped counts: it runs nothing)."""
    try:
        return "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return True


def test_a_spawned_child_goes_when_its_parent_is_killed(tmp_path: Path) -> None:
    """PR_SET_PDEATHSIG, asked for by the child: the parent is SIGKILLed, and its child gets
    SIGTERM instead of living on as an orphan."""
    script = tmp_path / "parent.py"
    script.write_text(
        "import sys, time\n"
        "from runtime.processes.parent import spawn\n"
        f"child = spawn([sys.executable, '-c', {CHILD!r}])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, str(script)], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        time.sleep(0.5)  # the child has asked by now (a slower one finds its parent gone and stops)
        parent.kill()
        parent.wait(10)
        eventually(lambda: _gone(child), 10, "the child gone", interval=0.02)
    finally:
        if parent.poll() is None:
            parent.kill()


def test_a_child_whose_parent_is_not_the_one_named_stops_at_once_and_passes_nothing_on() -> None:
    """A parent that died before the child asked would send nothing: the child sees another
    parent and stops. A process nobody spawned goes on, and its own children see no name."""
    code = FOLLOW + "import os, sys\nok = follow_parent()\nprint(ok, os.environ.get('SPINE_PARENT_PID'))\nsys.exit(0 if ok else 1)"
    orphan = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30,
                            env={**os.environ, PARENT_PID_ENV: "1"})
    assert (orphan.returncode, orphan.stdout.split()) == (1, ["False", "None"])
    ours = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30,
                          env={**os.environ, PARENT_PID_ENV: str(os.getpid())})
    assert (ours.returncode, ours.stdout.split()) == (0, ["True", "None"])
    nobody = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30,
                            env={k: v for k, v in os.environ.items() if k != PARENT_PID_ENV})
    assert (nobody.returncode, nobody.stdout.split()) == (0, ["True", "None"])


def test_children_spawned_beside_live_grpc_calls_all_start() -> None:
    """The regression: with `preexec_fn`, Python forks and gRPC's fork handlers restart its
    poller in the child, which then aborts on the epoll descriptor `close_fds` closed (7 of
    300 such children here). `spawn` takes no fork hook, so none of these may die that way."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = health_pb2_grpc.HealthStub(channel)
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            stub.Check(health_pb2.HealthCheckRequest(), timeout=5)

    caller = threading.Thread(target=busy, daemon=True)
    caller.start()
    try:
        failures = []
        for _ in range(150):
            child = spawn(["true"], stderr=subprocess.PIPE)
            _, err = child.communicate(timeout=30)
            if child.returncode != 0 or b"epoll" in err:
                failures.append((child.returncode, err[:200]))
        assert failures == []
    finally:
        stop.set()
        caller.join(10)
        channel.close()
        server.stop(None)
    with pytest.raises(TypeError, match="preexec_fn"):
        spawn(["true"], preexec_fn=lambda: None)
