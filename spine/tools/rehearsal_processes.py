"""The rehearsal's child processes: started in sessions of their own, logged to files, stopped by PID.

Each child gets its own session, so a Ctrl-C in the terminal reaches only the rehearsal,
which then stops every child it started — SIGTERM and then, after a grace, SIGKILL — by the
PID it recorded; never by name. A `spine up` stops its own children (and they die with it).
"""

from __future__ import annotations

import json
import os
import queue
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class RehearsalError(RuntimeError):
    pass


@dataclass
class Child:
    name: str
    argv: list[str]
    process: subprocess.Popen[str]
    out: Path  # stdout (a file, unless the child speaks a line protocol on pipes)
    err: Path
    _lines: queue.Queue[str] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, chars: int = 1500) -> str:
        text = self.err.read_text(errors="replace") if self.err.exists() else ""
        return text[-chars:]

    def died(self) -> RehearsalError:
        return RehearsalError(f"{self.name} (pid {self.pid}) exited with {self.process.returncode}; the end of its "
                              f"log {self.err}:\n{self.log_tail()}")

    def ready_line(self, timeout_s: float, startswith: str = "{") -> str:
        """The first line of its stdout file starting with `startswith` (a `spine up` ready line
        is JSON), once it is there."""
        deadline = time.monotonic() + timeout_s
        while True:
            text = self.out.read_text(errors="replace") if self.out.exists() else ""
            for line in text.splitlines():
                if line.startswith(startswith):
                    return line
            if not self.alive():
                raise self.died()
            if time.monotonic() > deadline:
                raise RehearsalError(f"{self.name} (pid {self.pid}) not ready within {timeout_s:g}s; the end of "
                                     f"its log {self.err}:\n{self.log_tail()}")
            time.sleep(0.1)

    def ready_json(self, timeout_s: float) -> dict[str, Any]:
        return dict(json.loads(self.ready_line(timeout_s)))

    # -- a child that answers commands on stdin with JSON lines on stdout --------------------

    def ask(self, command: str, timeout_s: float = 10.0) -> dict[str, Any]:
        assert self.process.stdin is not None and self._lines is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise RehearsalError(f"{self.name} did not answer {command!r} within {timeout_s:g}s") from None
        if not line:
            raise self.died()
        return dict(json.loads(line))


class Processes:
    """Every process the rehearsal starts, in order; `stop_all` stops them newest first."""

    def __init__(self, logs: Path, env: Mapping[str, str] | None = None) -> None:
        self.logs = logs
        self.env = dict(env if env is not None else os.environ)
        self.children: list[Child] = []
        self.stopped: list[tuple[str, int, int | None]] = []  # (name, pid, exit code)

    def start(self, name: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              pipes: bool = False) -> Child:
        """Start `argv`; stdout to a file (or, with `pipes`, a line protocol on stdin/stdout)."""
        self.logs.mkdir(parents=True, exist_ok=True)
        out, err = self.logs / f"{name}.out", self.logs / f"{name}.log"
        with err.open("a") as err_file, (open(os.devnull, "w") if pipes else out.open("a")) as out_file:
            process = subprocess.Popen(
                list(argv), env={**self.env, **(env or {})}, text=True, start_new_session=True,
                stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
                stdout=subprocess.PIPE if pipes else out_file, stderr=err_file)
        child = Child(name, list(argv), process, out, err)
        if pipes:
            child._lines = queue.Queue()
            threading.Thread(target=_pump, args=(process, child._lines), daemon=True,
                             name=f"{name}-stdout").start()
        self.children.append(child)
        return child

    def stop(self, child: Child, grace_s: float = 15.0) -> int | None:
        """SIGTERM, and SIGKILL after `grace_s`, to this child's PID (a child that speaks on
        stdin is asked to stop first by closing its input)."""
        process = child.process
        if process.stdin is not None and not process.stdin.closed:
            try:
                process.stdin.close()
            except OSError:
                pass
            try:
                process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        if process.poll() is None:
            os.kill(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.kill(process.pid, signal.SIGKILL)
                process.wait(timeout=grace_s)
        if child in self.children:
            self.children.remove(child)
            self.stopped.append((child.name, child.pid, process.returncode))
        return process.returncode

    def stop_all(self, grace_s: float = 15.0) -> None:
        """Stop every child still running: those that speak on stdin (the clients) first, then
        all the others at once (`stop_group`)."""
        children = list(reversed(self.children))
        for child in [c for c in children if c.process.stdin is not None]:
            try:
                self.stop(child, grace_s=5.0)
            except Exception:  # keep stopping the others
                _kill(child)
        self.stop_group([c for c in children if c in self.children], grace_s)

    def stop_group(self, children: Sequence[Child], grace_s: float = 15.0) -> None:
        """SIGTERM to each PID at once, one shared grace (a process still starting finishes its
        start before it stops), then SIGKILL to any left."""
        for child in children:
            if child.alive():
                try:
                    os.kill(child.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for child in children:
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill(child)
            if child in self.children:
                self.children.remove(child)
                self.stopped.append((child.name, child.pid, child.process.poll()))


def _kill(child: Child) -> None:
    if child.alive():
        os.kill(child.pid, signal.SIGKILL)
        child.process.wait(timeout=10)


def _pump(process: subprocess.Popen[str], lines: queue.Queue[str]) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        lines.put(line)
    lines.put("")  # end of output


def command_line(argv: Sequence[str], workdir: Path) -> str:
    """`argv` as a shell line, with the work directory shortened to $WORK."""
    return shlex.join(argv).replace(str(workdir), "$WORK")


def base_env() -> dict[str, str]:
    """This environment, without an xDS bootstrap of its own (each client gets the rehearsal's)."""
    env = dict(os.environ)
    env.pop("GRPC_XDS_BOOTSTRAP", None)
    env.pop("GRPC_XDS_BOOTSTRAP_CONFIG", None)
    return env


