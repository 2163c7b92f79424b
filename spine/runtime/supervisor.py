"""Supervise the layered layout's processes: start, wait for SERVING, restart, stop.

Each child is a real OS process running `python -m spine.runtime.process`. A child is ready
when its gRPC health check says SERVING — deep health (spine/health.py) where the child
runs a model, so "ready" means its model can run a forward on its device. Readiness is
watched for as long as the child lives (`ready()`): a child whose device fails turns not
ready without exiting, and turns ready again when its probe passes. A child that exits while the supervisor is
running is restarted (with a short backoff); on stop every child gets SIGTERM (to flush
its logs and metrics) and, after a grace period, SIGKILL. Children ask the kernel to
terminate them if the supervisor dies, so no orphan outlives it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from spine.runtime.health import check_serving
from spine.runtime.server import wait_serving

log = logging.getLogger("spine.supervisor")


class ChildFailed(RuntimeError):
    """A child did not become healthy in time; its log file says why."""


@dataclass
class Child:
    name: str
    argv: list[str]
    address: str
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = 0.0
    healthy: threading.Event = field(default_factory=threading.Event)
    ready_seen: subprocess.Popen[bytes] | None = None  # the process start-up readiness was confirmed for

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None


class Supervisor:
    """Starts children, watches them, restarts the ones that crash, stops them all."""

    def __init__(self, run_dir: Path, *, ready_timeout: float = 60.0, restart_backoff: float = 0.2,
                 health_interval: float = 1.0) -> None:
        self.run_dir = run_dir
        self.ready_timeout = ready_timeout
        self.restart_backoff = restart_backoff
        self.health_interval = health_interval
        self.children: dict[str, Child] = {}
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._monitor: threading.Thread | None = None
        self._health_monitor: threading.Thread | None = None
        self._channels: dict[str, grpc.Channel] = {}

    def add_component(self, component: str, config_path: Path) -> Child:
        """A `spine.runtime.process` child serving `component` on a unix socket in the run dir."""
        address = f"unix:{self.run_dir / (component + '.sock')}"
        argv = [sys.executable, "-m", "spine.runtime.process", component, "--listen", address,
                "--config", str(config_path), "--run-dir", str(self.run_dir), "--parent-pid", str(os.getpid())]
        child = Child(component, argv, address, self.run_dir / "logs" / f"{component}.log")
        self.children[component] = child
        return child

    def start(self) -> None:
        """Start every child and wait until each reports SERVING."""
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        for child in self.children.values():
            self._spawn(child)
        for child in self.children.values():
            self._await_healthy(child)
        self._monitor = threading.Thread(target=self._watch, name="supervisor", daemon=True)
        self._monitor.start()
        self._health_monitor = threading.Thread(target=self._watch_health, name="supervisor-health", daemon=True)
        self._health_monitor.start()

    def ready(self) -> dict[str, bool]:
        """Each child's readiness as last seen: SERVING by its (deep) health check."""
        return {name: child.healthy.is_set() for name, child in self.children.items()}

    def refresh_health(self) -> dict[str, bool]:
        """Check every running child's health once; log and record each change."""
        for name, child in list(self.children.items()):
            process = child.process
            if process is not None and (process.poll() is not None or child.ready_seen is not process):
                continue  # exited, or (re)starting: the restart loop owns it until it is first ready
            channel = self._channels.get(name)
            if channel is None:
                channel = self._channels[name] = grpc.insecure_channel(child.address)
            serving = check_serving(channel, timeout=0.5) is True
            with self._lock:
                if child.process is not process:
                    continue  # restarted while we asked: this answer is about the old process
                if serving and not child.healthy.is_set():
                    log.info("%s (pid %s) is SERVING again", name, child.pid)
                    child.healthy.set()
                elif not serving and child.healthy.is_set():
                    log.warning("%s (pid %s) is not SERVING: its health check failed", name, child.pid)
                    child.healthy.clear()
        return self.ready()

    def _watch_health(self) -> None:
        while not self._stopping.wait(self.health_interval):
            self.refresh_health()

    def _spawn(self, child: Child) -> None:
        sock = child.address.removeprefix("unix:")
        if child.address.startswith("unix:") and os.path.exists(sock):
            os.unlink(sock)  # a stale socket from the crashed instance
        child.healthy.clear()
        out = open(child.log_path, "ab")  # noqa: SIM115 - the child owns it for its lifetime
        try:
            child.process = subprocess.Popen(child.argv, stdout=out, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, cwd=os.getcwd())
        finally:
            out.close()
        child.started_at = time.monotonic()

    def _await_healthy(self, child: Child) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if child.process is not None and child.process.poll() is not None:
                raise ChildFailed(f"{child.name} exited with code {child.process.returncode} while starting; "
                                  f"see {child.log_path}:\n{_tail(child.log_path)}")
            if wait_serving(child.address, timeout=0.5):
                child.ready_seen = child.process
                child.healthy.set()
                log.info("%s SERVING on %s (pid %s)", child.name, child.address, child.pid)
                return
        raise ChildFailed(f"{child.name} did not report SERVING within {self.ready_timeout:.0f}s; "
                          f"see {child.log_path}:\n{_tail(child.log_path)}")

    def _watch(self) -> None:
        while not self._stopping.wait(0.1):
            for child in list(self.children.values()):
                process = child.process
                if process is None or process.poll() is None or self._stopping.is_set():
                    continue
                with self._lock:
                    if self._stopping.is_set():
                        return
                    child.restarts += 1
                    log.warning("%s (pid %s) exited with code %s; restarting (restart #%d)",
                                child.name, process.pid, process.returncode, child.restarts)
                    time.sleep(self.restart_backoff)
                    self._spawn(child)
                try:
                    self._await_healthy(child)
                except ChildFailed as error:
                    log.error("%s", error)

    def pids(self) -> dict[str, int]:
        return {name: child.pid for name, child in self.children.items() if child.pid is not None}

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM every child, wait for them to flush and exit, SIGKILL the rest."""
        self._stopping.set()
        with self._lock:
            processes = [c.process for c in self.children.values() if c.process is not None]
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for process in processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._monitor is not None:
            self._monitor.join(timeout=2.0)
        if self._health_monitor is not None:
            self._health_monitor.join(timeout=2.0)
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
