"""The rehearsal's child processes: started in sessions of their own, logged to files, stopped by PID.

Each child gets its own session, so a Ctrl-C in the terminal reaches only the rehearsal,
which then stops every child it started — SIGTERM and then, after a grace, SIGKILL — by the
PID it recorded; never by name. A `spine up` stops its own children (and they die with it).
"""

from __future__ import annotations

import json
import os
import shlex
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.processes.launch import Launched, launch, starting_with


class RehearsalError(RuntimeError):
    pass


@dataclass
class Child:
    """One of the rehearsal's children (`runtime.processes.launch`): its stdout copied to `out`, its stderr in `err`."""

    name: str
    launched: Launched
    out: Path
    err: Path

    @property
    def argv(self) -> list[str]:
        return self.launched.argv

    @property
    def pid(self) -> int:
        return self.launched.pid

    @property
    def process(self) -> Any:
        return self.launched.process

    def alive(self) -> bool:
        return self.launched.alive()

    def log_tail(self, chars: int = 1500) -> str:
        text = self.err.read_text(errors="replace") if self.err.exists() else ""
        return text[-chars:]

    def died(self) -> RehearsalError:
        return RehearsalError(f"{self.name} (pid {self.pid}) exited with {self.launched.returncode}; the end of its "
                              f"log {self.err}:\n{self.log_tail()}")

    def ready_line(self, timeout_s: float, startswith: str = "{") -> str:
        """The first line of its stdout starting with `startswith` (a `spine up` ready line is
        JSON), once it is there."""
        found = self.launched.wait_for(starting_with(startswith), timeout_s)
        if found is not None:
            return str(found["line"])
        if not self.alive():
            raise self.died()
        raise RehearsalError(f"{self.name} (pid {self.pid}) not ready within {timeout_s:g}s; the end of "
                             f"its log {self.err}:\n{self.log_tail()}")

    def ready_json(self, timeout_s: float) -> dict[str, Any]:
        return dict(json.loads(self.ready_line(timeout_s)))

    # -- a child that answers commands on stdin with JSON lines on stdout --------------------

    def ask(self, command: str, timeout_s: float = 10.0) -> dict[str, Any]:
        try:
            self.launched.send(command)
        except OSError:
            raise self.died() from None
        found = self.launched.wait_for(lambda line: {"line": line}, timeout_s)
        if found is None:
            if not self.alive():
                raise self.died()
            raise RehearsalError(f"{self.name} did not answer {command!r} within {timeout_s:g}s")
        return dict(json.loads(found["line"]))


class Processes:
    """Every process the rehearsal starts, in order; `stop_all` stops them newest first."""

    def __init__(self, logs: Path, env: Mapping[str, str] | None = None) -> None:
        self.logs = logs
        self.env = dict(env if env is not None else os.environ)
        self.children: list[Child] = []
        self.stopped: list[tuple[str, int, int | None]] = []  # (name, pid, exit code)

    def start(self, name: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              pipes: bool = False) -> Child:
        """Start `argv` in a session of its own, so a Ctrl-C reaches only the rehearsal; stdout
        copied to a file (or, with `pipes`, a line protocol on stdin/stdout)."""
        out, err = self.logs / f"{name}.out", self.logs / f"{name}.log"
        launched = launch(name, argv, log_path=err, out_path=None if pipes else out, env={**self.env, **(env or {})},
                          stdin=pipes, own_session=True, append=True)
        child = Child(name, launched, out, err)
        self.children.append(child)
        return child

    def stop(self, child: Child, grace_s: float = 15.0) -> int | None:
        """SIGTERM, and SIGKILL after `grace_s`, to this child's PID (a child that speaks on
        stdin is asked to stop first by closing its input)."""
        if child.launched.process.stdin is not None:
            child.launched.close_stdin()
            deadline = time.monotonic() + grace_s
            while child.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
        code = child.launched.stop(grace_s)
        self._forget(child)
        return code

    def stop_all(self, grace_s: float = 15.0) -> None:
        """Stop every child still running: those that speak on stdin (the clients) first, then
        all the others at once (`stop_group`)."""
        children = list(reversed(self.children))
        for child in [c for c in children if c.process.stdin is not None]:
            try:
                self.stop(child, grace_s=5.0)
            except Exception:  # keep stopping the others
                child.launched.stop(0.0)
                self._forget(child)
        self.stop_group([c for c in children if c in self.children], grace_s)

    def stop_group(self, children: Sequence[Child], grace_s: float = 15.0) -> None:
        """SIGTERM to each PID at once, one shared grace (a process still starting finishes its
        start before it stops), then SIGKILL to any left."""
        for child in children:
            child.launched.terminate()
        deadline = time.monotonic() + grace_s
        for child in children:
            child.launched.finish_stop(deadline)
            self._forget(child)

    def _forget(self, child: Child) -> None:
        if child in self.children:
            self.children.remove(child)
            self.stopped.append((child.name, child.pid, child.launched.returncode))


def command_line(argv: Sequence[str], workdir: Path) -> str:
    """`argv` as a shell line, with the work directory shortened to $WORK."""
    return shlex.join(argv).replace(str(workdir), "$WORK")


def base_env() -> dict[str, str]:
    """This environment, without an xDS bootstrap of its own (each client gets the rehearsal's)."""
    env = dict(os.environ)
    env.pop("GRPC_XDS_BOOTSTRAP", None)
    env.pop("GRPC_XDS_BOOTSTRAP_CONFIG", None)
    return env


