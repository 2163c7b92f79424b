"""`spine up` as a process tree of its own, started and stopped by the cutover (by PID).

The base of `LayeredProcess` (the layered stack) and `SpineProcess` (a spine that follows
the controller's stages over ADS): its config file `<name>-config.yaml` beside its run
directory (it holds the internal secret: private to this user), its stderr in `<name>.log`
there too, its `ready` line awaited with a deadline, SIGTERM then SIGKILL to stop it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import yaml

from runtime.parent import spawn
from runtime.ready_line import first_event
from runtime.run_dir import write_private
from services.common import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]


class LayoutProcess:
    """One `spine up` child on loopback, its run directory `run_dir`."""

    name = "layout"  # its config file, log and thread names

    def __init__(self, config: Mapping[str, Any], run_dir: Path) -> None:
        self.config = config
        self.run_dir = run_dir
        self.process: subprocess.Popen[bytes] | None = None
        # Loopback TCP, not a unix socket: xDS data planes (Envoy, proxyless clients) are
        # sent its address as an endpoint. Port 0: `spine up` says which in its ready line.
        self.address = ""
        self.http_address: str | None = None  # its HTTP API (`http_address` in the ready line)

    @property
    def log_path(self) -> Path:
        return self.run_dir.parent / f"{self.name}.log"

    def log_tail(self, chars: int = 1500) -> str:
        """The end of its log (what to show when it failed)."""
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def up_arguments(self) -> Sequence[str]:
        """What follows `spine --config F up` (the layout and whatever else this child needs)."""
        raise NotImplementedError

    def start(self, timeout_s: float = 120.0) -> str:
        """Start it and wait for its `ready` line; the gateway's address."""
        self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        config_file = write_private(self.run_dir.parent, f"{self.name}-config.yaml", yaml.safe_dump(dict(self.config)))
        with self.log_path.open("wb") as log:
            self.process = spawn(
                [sys.executable, "-m", "spine", "--config", str(config_file), "up", *self.up_arguments(),
                 "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", "--run-dir", str(self.run_dir)],
                cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=log, stdin=self._stdin())
        self._await_ready(timeout_s)
        return self.address

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM (it stops its children and flushes), then SIGKILL after `grace_s`."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            os.kill(process.pid, signal.SIGTERM)
            try:
                process.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.kill(process.pid, signal.SIGKILL)
                process.wait(5)
        if process.stdin is not None:
            process.stdin.close()
        # stdout is left to the reader thread: it ends at EOF, once the tree has exited

    def _stdin(self) -> int:
        return subprocess.DEVNULL

    def _read_after_ready(self, stdout: IO[bytes]) -> None:
        """What it prints after `ready` (nothing much): read, so a full pipe never blocks it."""
        try:
            while stdout.read(65536):
                pass
        except (OSError, ValueError):
            pass
        finally:
            stdout.close()

    def _await_ready(self, timeout_s: float) -> None:
        assert self.process is not None
        event = first_event(self.process, time.monotonic() + timeout_s)
        if event is not None and event["event"] == "ready":
            self.address = str(event["address"])
            self.http_address = event.get("http_address")
            threading.Thread(target=self._read_after_ready, args=(self.process.stdout,), name=f"{self.name}-stdout",
                             daemon=True).start()
            return
        why = "exited before serving" if self.process.poll() is not None else f"did not come up within {timeout_s:g}s"
        self.stop()
        raise ConfigError(f"the {self.name} process {why}; its log ({self.log_path}):\n{self.log_tail()}")
