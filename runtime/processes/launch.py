"""One way to start a layout: a process tree with its ready line, its PIDs, its stop.

The bench, `spine ab`, the migration's traffic (the demo), the rehearsal and the tests all
start servers as children — `spine up`, `runtime.process`, `spine.tools.ab.serve`, the
controller — and each needs the same four things, which used to be written four times:

- **its output read from the start** by one thread, each stdout line queued (and copied to
  a file when asked), so a child never blocks on a full pipe and whoever waits for a line
  (`wait_for`) finds it past whatever the child printed first;
- **its ready line** awaited with a deadline: `{"event": "ready", "address": …}` from
  `spine up` and `ab.serve` (or `{"event": "failed", …}`), `"<component> serving on <address>"`
  from `runtime.process` (`serving_on`); an exit or the deadline ends the wait early;
- **its PIDs**: the root's, and every descendant seen (`tree`), remembered so that `stop`
  reaps by PID whatever outlived the root — never by name;
- **its stop**: SIGTERM to the root (a `spine up` stops its own children and flushes), SIGKILL
  after a grace, then SIGTERM/SIGKILL to any remembered descendant still alive.

A child normally dies with the thread that started it (`runtime.processes.parent.spawn`: no orphans
if the starter is killed); one that must outlive a thread, or take a Ctrl-C of its own
(the rehearsal's), starts in a session of its own instead (`own_session=True`).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import psutil

from runtime.processes.parent import spawn

REPO_ROOT = Path(__file__).resolve().parents[2]
LineMatch = Callable[[str], "dict[str, Any] | None"]  # a stdout line -> what it says, or None to skip it


class LaunchFailed(RuntimeError):
    """A child did not come up (the message says why and ends with its log's tail)."""


def json_event(line: str) -> dict[str, Any]:
    """The JSON object a line holds (`{}` for any other line)."""
    try:
        value = json.loads(line)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def events(*names: str) -> LineMatch:
    """Match the JSON lines whose `event` is one of `names`."""
    def match(line: str) -> dict[str, Any] | None:
        event = json_event(line)
        return event if event.get("event") in names else None
    return match


READY = events("ready", "failed")  # what `spine up` and `spine.tools.ab.serve` print once, when they serve or fail


def serving_on(line: str) -> dict[str, Any] | None:
    """`runtime.process`'s ready line, `<component> serving on <address>`, as a ready event."""
    marker = " serving on "
    return {"event": "ready", "address": line.split(marker, 1)[1].strip()} if marker in line else None


def starting_with(prefix: str) -> LineMatch:
    """Match the lines that start with `prefix` (as `{"line": …}`)."""
    return lambda line: {"line": line} if line.startswith(prefix) else None


def spine_up_argv(config: Path | str | None, layout: str, *, listen: str, http_listen: str, run_dir: Path | str,
                  extra: Sequence[str] = ()) -> list[str]:
    """`python -m spine --config C up --layout L …`: a layout as `spine up` serves it (the
    default config without `config`)."""
    configured = ["--config", str(config)] if config is not None else []
    return [sys.executable, "-m", "spine", *configured, "up", "--layout", layout, *extra,
            "--listen", listen, "--http-listen", http_listen, "--run-dir", str(run_dir)]


class Launched:
    """One child process and its tree, started by `launch`."""

    def __init__(self, name: str, argv: Sequence[str], process: subprocess.Popen[bytes], log_path: Path,
                 out_path: Path | None) -> None:
        self.name = name
        self.argv = list(argv)
        self.process = process
        self.log_path = log_path
        self.out_path = out_path
        self.lines: queue.Queue[str | None] = queue.Queue()  # stdout, line by line; None at its end
        self._known: dict[int, psutil.Process] = {}
        self._ended = threading.Event()  # its stdout reached its end
        self._reader = threading.Thread(target=self._read, name=f"{name}-stdout", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, chars: int = 1500) -> str:
        """The end of its log (stderr): what to show when it failed."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    # -- its output --------------------------------------------------------------------------

    def _read(self) -> None:
        stdout = self.process.stdout
        assert stdout is not None
        copy: IO[str] | None = None
        try:
            copy = self.out_path.open("a") if self.out_path is not None else None
            for raw in stdout:
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                if copy is not None:
                    copy.write(line + "\n")
                    copy.flush()
                self.lines.put(line)
        except (OSError, ValueError):
            pass  # the pipe was closed under us: the child is being stopped
        finally:
            self._ended.set()
            self.lines.put(None)
            if copy is not None:
                copy.close()

    def wait_for(self, match: LineMatch, timeout_s: float) -> dict[str, Any] | None:
        """The first line from now on that `match` accepts (earlier ones are dropped), as it
        reads it; None when the output ends (the child exited) or `timeout_s` passes first."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                line = self.lines.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            if line is None:
                self.lines.put(None)  # the end stays the end for the next reader
                return None
            found = match(line)
            if found is not None:
                return found

    def wait_ready(self, timeout_s: float, match: LineMatch = READY) -> dict[str, Any]:
        """Its ready event (`{"event": "ready", "address": …}`); the tree is remembered then.
        `LaunchFailed` on a `failed` event, an exit first, or no ready line in `timeout_s`
        (the child is stopped then)."""
        event = self.wait_for(match, timeout_s)
        if event is not None and event.get("event", "ready") == "ready":
            self.tree()  # every child now, so stop() can reap them by PID
            return event
        if event is None and self._ended.is_set():  # its stdout closed: it is exiting
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=5)
        if event is not None:
            why = f"failed to start: {event.get('error')}"
        elif self.alive():
            why = f"did not come up within {timeout_s:g}s"
        else:
            why = f"exited with code {self.process.returncode} before serving"
        self.stop()
        raise LaunchFailed(f"{self.name} {why}; its log ({self.log_path}):\n{self.log_tail()}")

    def send(self, line: str) -> None:
        """Write one line to its stdin (started with `stdin=True`); OSError when it is gone."""
        stdin = self.process.stdin
        if stdin is None:
            raise OSError(f"{self.name}: started without a stdin to write to")
        stdin.write(line.encode() + b"\n")
        stdin.flush()

    # -- its PIDs --------------------------------------------------------------------------------

    def tree(self) -> list[psutil.Process]:
        """The root and every descendant alive now (each remembered for `stop`)."""
        procs = process_tree(self.pid)
        for proc in procs:
            self._known.setdefault(proc.pid, proc)
        return procs

    def alive_pids(self) -> list[int]:
        """The PIDs of this tree still running (none once stopped)."""
        alive = []
        for proc in self._known.values():
            with contextlib.suppress(psutil.Error):
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc.pid)
        return alive

    # -- its stop -----------------------------------------------------------------------------

    def close_stdin(self) -> None:
        if self.process.stdin is not None and not self.process.stdin.closed:
            with contextlib.suppress(OSError):
                self.process.stdin.close()

    def terminate(self) -> None:
        """SIGTERM to the root, if it runs (`finish_stop` waits for it)."""
        self.tree()
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)

    def finish_stop(self, deadline: float) -> int | None:
        """Wait for the root until `deadline` (time.monotonic()), SIGKILL it then; stop any
        remembered descendant left; its exit code."""
        try:
            self.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self.process.wait(timeout=10)
        leftovers = [proc for pid, proc in self._known.items() if pid != self.pid and _running(proc)]
        for proc in leftovers:
            with contextlib.suppress(psutil.Error):
                proc.terminate()
        _, alive = psutil.wait_procs(leftovers, timeout=5)
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(alive, timeout=5)
        self.close_stdin()
        return self.process.returncode

    def stop(self, grace_s: float = 15.0) -> int | None:
        """SIGTERM, SIGKILL after `grace_s`, then whatever of its tree is left; its exit code.
        Safe to call twice."""
        self.terminate()
        return self.finish_stop(time.monotonic() + grace_s)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running()
    except psutil.Error:
        return False


def process_tree(pid: int) -> list[psutil.Process]:
    """A process and all its descendants alive now (empty once it is gone)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def launch(name: str, argv: Sequence[str], *, log_path: Path, out_path: Path | None = None,
           cwd: Path = REPO_ROOT, env: Mapping[str, str] | None = None, stdin: bool = False,
           own_session: bool = False, append: bool = False) -> Launched:
    """Start `argv` as `name`: stderr to `log_path`, stdout read line by line (and copied to
    `out_path`), stdin a pipe with `stdin`; the log starts anew unless `append`. In `cwd` (this checkout: `python -m` imports its
    packages first). The child dies with the calling thread (`runtime.processes.parent.spawn`: call
    from a thread that outlives it) unless `own_session` puts it in a session of its own."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    popen: dict[str, Any] = {"cwd": cwd, "stdout": subprocess.PIPE,
                             "stdin": subprocess.PIPE if stdin else subprocess.DEVNULL}
    with log_path.open("ab" if append else "wb") as log:
        if own_session:
            process = subprocess.Popen(list(argv), env=dict(os.environ if env is None else env), stderr=log,
                                       start_new_session=True, **popen)
        else:
            process = spawn(argv, env=env, stderr=log, **popen)
    return Launched(name, argv, process, log_path, out_path)

