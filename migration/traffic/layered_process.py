"""The layered stack as a process tree of its own: `spine up --layout layered`.

Why: the demo's spine runs inside the demo's process (so a stage can move its placements
and a fault can be injected without a restart). When the layered stack's gateway ran there
too, the spine's model shared one interpreter with the other side's gateway and every
request it forwarded, and the tables compared a spine slowed by the layered side's work
with a layered side that had the machine to itself. Here the layered side is what it is in
production: its gateway and every component in processes of their own.

The spine still shares the layered component processes for whatever it has not collapsed:
their addresses are fixed by the run directory (`<run dir>/<component>.sock`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import grpc
import yaml

from services.common import ConfigError
from services.registry import MIDDLEWARES
from spine.runtime.process import die_with_parent
from spine.runtime.ready_line import first_event
from spine.runtime.run_dir import write_private
from spine.v1 import ratelimit_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[2]


class LayeredProcess:
    """`spine up --layout layered` on loopback, its run directory `run_dir`; stopped by its PID."""

    def __init__(self, config: Mapping[str, Any], run_dir: Path) -> None:
        self.config = config
        self.run_dir = run_dir
        self.process: subprocess.Popen[bytes] | None = None
        # Loopback TCP, not a unix socket: xDS data planes (Envoy, proxyless clients) are
        # sent its address as an endpoint. Port 0: `spine up` says which in its ready line.
        self.address = ""
        self._channel: grpc.Channel | None = None

    def start(self, timeout_s: float = 120.0) -> str:
        """Start it and wait for its `ready` line; the gateway's address."""
        self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        # The config holds the internal secret: private to this user, like every run dir file.
        config_file = write_private(self.run_dir.parent, "layered-config.yaml", yaml.safe_dump(dict(self.config)))
        with (self.run_dir.parent / "layered.log").open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "spine", "--config", str(config_file), "up", "--layout", "layered",
                 "--listen", "127.0.0.1:0", "--run-dir", str(self.run_dir)],
                cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent)
        self._await_ready(timeout_s)
        return self.address

    def component_addresses(self) -> dict[str, str]:
        """Where each layered middleware listens (the spine's remote placements)."""
        return {name: f"unix:{self.run_dir / (name + '.sock')}" for name in MIDDLEWARES}

    def ratelimit(self) -> ratelimit_pb2_grpc.RateLimitStub:
        """A stub on the layered rate limiter (its share of every limit is set through it)."""
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.component_addresses()["ratelimit"])
        return ratelimit_pb2_grpc.RateLimitStub(self._channel)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM (it stops its children and flushes), then SIGKILL after `grace_s`."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None
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
        # stdout is left to the drain thread: it ends at EOF, once the tree has exited

    @staticmethod
    def _drain(stdout: Any) -> None:
        """Read what it prints after `ready` (nothing much), so a full pipe never blocks it."""
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
            threading.Thread(target=self._drain, args=(self.process.stdout,), name="layered-stdout",
                             daemon=True).start()
            return
        why = "exited before serving" if self.process.poll() is not None else f"did not come up within {timeout_s:g}s"
        log = self.run_dir.parent / "layered.log"
        self.stop()
        tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
        raise ConfigError(f"the layered stack {why}; its log ({log}):\n{tail}")
