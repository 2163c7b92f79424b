"""Supervise the layered layout's processes: start, wait for SERVING, restart, stop.

Each child is a real OS process running `python -m runtime.process`. A child is ready
when its gRPC health check says SERVING — deep health (runtime/health/deep.py) where the child
runs a model, so "ready" means its model can run a forward on its device. Readiness is
watched for as long as the child lives (`ready()`): a child whose device fails turns not
ready without exiting, and turns ready again when its probe passes.

A child that exits while the supervisor runs is restarted after a backoff that doubles with
each exit in a row (`restart_backoff`, 0.2 s, up to `max_restart_backoff`, 10 s) and starts
over once a child has stayed up `stable_after_s`. `crash_loop_after` exits in a row make a
**crash loop**: logged once, shown by `status()`, and reported by `down_reason()` (which the
gateway's health reads) until the child has stayed up and SERVING for `stable_after_s`. A
restarted child that does not report SERVING within `ready_timeout` is killed and counts as
an exit. Nothing sleeps while holding the lock: the monitor only schedules restarts and
starts them when due.

On stop every child gets SIGTERM (to flush its logs and metrics) and, after a grace period,
SIGKILL. Children ask the kernel to terminate them if the supervisor dies, so no orphan
outlives it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from runtime.health.watch import Rounds, check_many, health_channel
from runtime.processes.parent import spawn
from runtime.server import wait_serving

log = logging.getLogger("spine.supervisor")


class ChildFailed(RuntimeError):
    """A child did not become healthy in time; its log file says why."""


@dataclass(frozen=True)
class Exit:
    """One exit of a child: when it started and ended, its code, and the delay before the next start."""

    started_at: float
    exited_at: float
    code: int | None
    delay_s: float


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
    failures: int = 0  # exits in a row, none of them after staying up stable_after_s
    crash_loop: bool = False
    restart_at: float | None = None  # monotonic time of the scheduled restart (None: not scheduled)
    serving_since: float | None = None
    exits: deque[Exit] = field(default_factory=lambda: deque(maxlen=32))

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    # Its changes, made by the supervisor that keeps it (under its lock), through these: the
    # record says what each one means, rather than every caller setting its fields in step.
    def started(self, process: subprocess.Popen[bytes], now: float, *, restart: bool = False) -> None:
        """A process of it started: the first, or a `restart`'s."""
        self.restarts += restart
        self.process = process
        self.started_at = now
        self.restart_at = None

    def serving(self, process: subprocess.Popen[bytes] | None, now: float) -> None:
        """It answered SERVING: its start-up readiness is confirmed for `process`."""
        self.ready_seen = process
        self.healthy.set()
        self.serving_since = now

    def not_serving(self) -> None:
        self.healthy.clear()
        self.serving_since = None

    def steady(self) -> None:
        """It has stayed up long enough: no exits in a row, no crash loop."""
        self.failures, self.crash_loop = 0, False

    def exited(self, process: subprocess.Popen[bytes], now: float, *, stable: bool, backoff: Callable[[int], float],
               crash_loop_after: int) -> tuple[float, bool]:
        """Note an exit of `process` (after it stayed up `stable`, or not) and schedule its
        restart; the delay before it, and whether the exit began a crash loop."""
        self.failures = 1 if stable else self.failures + 1
        delay = backoff(self.failures)
        self.exits.append(Exit(self.started_at, now, process.returncode, delay))
        self.restart_at = now + delay
        self.not_serving()
        began = self.failures >= crash_loop_after and not self.crash_loop
        self.crash_loop = self.crash_loop or self.failures >= crash_loop_after
        return delay, began


class Supervisor:
    """Starts children, watches them, restarts the ones that crash, stops them all."""

    def __init__(self, run_dir: Path, *, ready_timeout: float = 60.0, restart_backoff: float = 0.2,
                 max_restart_backoff: float = 10.0, stable_after_s: float = 5.0, crash_loop_after: int = 3,
                 health_interval: float = 0.5, health_timeout: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.run_dir = run_dir
        # What starts, exits, backoffs and stability are timed on (a test moves its own
        # instead of sleeping through a backoff or `stable_after_s`).
        self._clock = clock
        self.ready_timeout = ready_timeout
        self.restart_backoff = restart_backoff
        self.max_restart_backoff = max_restart_backoff
        self.stable_after_s = stable_after_s
        self.crash_loop_after = crash_loop_after
        self.health_interval = health_interval
        self.health_timeout = health_timeout
        self.children: dict[str, Child] = {}
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._monitor = Rounds(self._tend_all, 0.1, "supervisor", join_s=2.0)
        self._health_monitor = Rounds(self.refresh_health, health_interval, "supervisor-health",
                                      join_s=health_interval + 2 * health_timeout + 1.0)
        self._channels: dict[str, grpc.Channel] = {}

    def add_component(self, component: str, config_path: Path) -> Child:
        """A `runtime.process` child serving `component` on a unix socket in the run dir."""
        address = f"unix:{self.run_dir / (component + '.sock')}"
        argv = [sys.executable, "-m", "runtime.process", component, "--listen", address,
                "--config", str(config_path), "--run-dir", str(self.run_dir)]
        child = Child(component, argv, address, self.run_dir / "logs" / f"{component}.log")
        self.children[component] = child
        return child

    def start(self) -> None:
        """Start every child and wait until each reports SERVING."""
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        for child in self.children.values():
            child.started(self._spawn(child), self._clock())
        for child in self.children.values():
            self._await_healthy(child)
        self._monitor.start()
        self._health_monitor.start()

    # -- what others read ------------------------------------------------------------------
    def ready(self) -> dict[str, bool]:
        """Each child's readiness as last seen: SERVING by its (deep) health check."""
        return {name: child.healthy.is_set() for name, child in self.children.items()}

    def backoff(self, failures: int) -> float:
        """The delay before the restart that follows `failures` exits in a row."""
        return float(min(self.restart_backoff * 2 ** max(failures - 1, 0), self.max_restart_backoff))

    def down_reason(self, name: str) -> str | None:
        """Why `name` cannot serve whatever its health check says (exited, restarting, crash
        loop), or None while its process runs and is not in a crash loop."""
        child = self.children[name]
        with self._lock:
            if child.crash_loop:
                last = child.exits[-1] if child.exits else None
                code = f", last exit code {last.code}" if last is not None else ""
                return f"crash loop: {child.failures} exits in a row{code}"
            process = child.process
            if process is not None and process.poll() is not None:
                return f"exited with code {process.returncode}; restarting"
            if child.restart_at is not None:
                return "restarting"
        return None

    def status(self) -> dict[str, dict[str, Any]]:
        """Per child: pid, state (serving | not_serving | starting | restarting | crash_loop),
        restarts, exits in a row, the last exit code and the next restart's delay."""
        now = self._clock()
        report: dict[str, dict[str, Any]] = {}
        with self._lock:
            for name, child in self.children.items():
                running = child.running
                if child.crash_loop:
                    state = "crash_loop"
                elif not running:
                    state = "restarting"
                elif child.ready_seen is not child.process:
                    state = "starting"
                else:
                    state = "serving" if child.healthy.is_set() else "not_serving"
                last = child.exits[-1] if child.exits else None
                report[name] = {
                    "pid": child.pid if running else None, "state": state, "restarts": child.restarts,
                    "exits_in_a_row": child.failures, "last_exit_code": last.code if last else None,
                    "next_restart_in_s": round(max(child.restart_at - now, 0.0), 3)
                    if child.restart_at is not None else None,
                }
        return report

    def pids(self) -> dict[str, int]:
        return {name: child.pid for name, child in self.children.items() if child.pid is not None}

    # -- readiness -------------------------------------------------------------------------
    def refresh_health(self) -> dict[str, bool]:
        """Check every running child's health once (all at once, each within `health_timeout`);
        log and record each change; a restarted child's first SERVING makes it ready."""
        asked: dict[str, tuple[grpc.Channel, str]] = {}
        processes: dict[str, subprocess.Popen[bytes] | None] = {}
        for name, child in list(self.children.items()):
            process = child.process
            if process is not None and process.poll() is not None:
                continue  # exited: the monitor owns it until it runs again
            channel = self._channels.get(name)
            if channel is None:
                channel = self._channels[name] = health_channel(child.address)
            asked[name] = (channel, "")
            processes[name] = process
        answers = check_many(asked, self.health_timeout)
        now = self._clock()
        with self._lock:
            if self._stopping.is_set():
                return self.ready()  # children are being stopped: not news
            for name, (serving, reason) in answers.items():
                child = self.children[name]
                process = processes[name]
                if child.process is not process:
                    continue  # restarted while we asked: this answer is about the old process
                if process is not None and child.ready_seen is not process:
                    if serving:  # a (re)started child's first SERVING
                        child.serving(process, now)
                        log.info("%s SERVING on %s (pid %s)", name, child.address, child.pid)
                    continue
                if serving and not child.healthy.is_set():
                    log.info("%s (pid %s) is SERVING again", name, child.pid)
                    child.serving(process, now)
                elif not serving and child.healthy.is_set():
                    log.warning("%s (pid %s) is not SERVING: %s", name, child.pid, reason)
                    child.not_serving()
        return self.ready()

    def _await_healthy(self, child: Child) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if child.process is not None and child.process.poll() is not None:
                raise ChildFailed(f"{child.name} exited with code {child.process.returncode} while starting; "
                                  f"see {child.log_path}:\n{_tail(child.log_path)}")
            if wait_serving(child.address, timeout=0.5):
                child.serving(child.process, self._clock())
                log.info("%s SERVING on %s (pid %s)", child.name, child.address, child.pid)
                return
        raise ChildFailed(f"{child.name} did not report SERVING within {self.ready_timeout:.0f}s; "
                          f"see {child.log_path}:\n{_tail(child.log_path)}")

    # -- restarts ----------------------------------------------------------------------------
    def _spawn(self, child: Child) -> subprocess.Popen[bytes]:
        sock = child.address.removeprefix("unix:")
        if child.address.startswith("unix:") and os.path.exists(sock):
            os.unlink(sock)  # a stale socket from the crashed instance
        out = open(child.log_path, "ab")  # noqa: SIM115 - the child owns it for its lifetime
        try:
            return spawn(child.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=os.getcwd())
        finally:
            out.close()

    def _tend_all(self) -> None:
        for child in list(self.children.values()):
            if self._tend(child):
                self._restart(child)

    def _tend(self, child: Child) -> bool:
        """One look at a child under the lock (no waiting there): note an exit and schedule its
        restart, kill a start that hangs, clear a crash loop that has ended. True when a
        restart is due now."""
        now = self._clock()
        with self._lock:
            if self._stopping.is_set():
                return False
            process = child.process
            if process is None:
                return False
            if process.poll() is not None:
                if child.restart_at is None:
                    self._schedule_restart(child, process, now)
                return now >= (child.restart_at or now)
            if child.ready_seen is not process and now - child.started_at > self.ready_timeout:
                log.error("%s (pid %s) did not report SERVING within %.0fs; killing it; see %s",
                          child.name, process.pid, self.ready_timeout, child.log_path)
                process.kill()  # the next look sees the exit and schedules a restart
            elif (child.failures and child.serving_since is not None and child.healthy.is_set()
                  and now - child.serving_since >= self.stable_after_s):
                if child.crash_loop:
                    log.warning("%s has stayed up for %.0fs: no longer in a crash loop", child.name,
                                now - child.started_at)
                child.steady()
        return False

    def _schedule_restart(self, child: Child, process: subprocess.Popen[bytes], now: float) -> None:
        stable = child.ready_seen is process and now - child.started_at >= self.stable_after_s
        delay, crash_loop_began = child.exited(process, now, stable=stable, backoff=self.backoff,
                                               crash_loop_after=self.crash_loop_after)
        if crash_loop_began:
            log.error("%s is in a crash loop: it exited %d times in a row (last exit code %s); "
                      "restarting with backoff up to %gs; see %s", child.name, child.failures,
                      process.returncode, self.max_restart_backoff, child.log_path)
        log.warning("%s (pid %s) exited with code %s; restart #%d in %.1fs", child.name, process.pid,
                    process.returncode, child.restarts + 1, delay)

    def _restart(self, child: Child) -> None:
        """Start a child whose restart is due; the process starts outside the lock."""
        process = self._spawn(child)
        with self._lock:
            if self._stopping.is_set():  # stop() has collected its processes already
                process.kill()
                process.wait()
                return
            child.started(process, self._clock(), restart=True)

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
        self._monitor.stop()
        self._health_monitor.stop()
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
