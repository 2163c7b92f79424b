"""`spine up` as a process tree of its own, started and stopped by the cutover (by PID).

The base of `LayeredProcess` (the layered stack) and `SpineProcess` (a spine that follows
the controller's stages over ADS): its config file `<name>-config.yaml` beside its run
directory (it holds the internal secret: private to this user), its stderr in `<name>.log`
there too; started, awaited and stopped by `runtime.processes.launch` (the one launcher).
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

from runtime.config.model import SpineConfig
from runtime.processes.launch import Launched, LaunchFailed, launch, spine_up_argv
from runtime.processes.run_dir import write_private
from services.common import ConfigError


class LayoutProcess:
    """One `spine up` child on loopback, its run directory `run_dir`."""

    name = "layout"  # its config file, log and thread names
    layout = ""  # its `spine up --layout`

    def __init__(self, config: SpineConfig, run_dir: Path) -> None:
        self.config = config
        self.run_dir = run_dir
        self.launched: Launched | None = None
        # Loopback TCP, not a unix socket: xDS data planes (Envoy, proxyless clients) are
        # sent its address as an endpoint. Port 0: `spine up` says which in its ready line.
        self.address = ""
        self.http_address: str | None = None  # its HTTP API (`http_address` in the ready line)

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        """Its root process while it runs (None before `start` and after `stop`)."""
        return self.launched.process if self.launched is not None else None

    @property
    def log_path(self) -> Path:
        return self.run_dir.parent / f"{self.name}.log"

    def log_tail(self, chars: int = 1500) -> str:
        """The end of its log (what to show when it failed)."""
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def up_arguments(self) -> Sequence[str]:
        """What else `spine up --layout L` needs for this child."""
        return ()

    def start(self, timeout_s: float = 120.0) -> str:
        """Start it and wait for its `ready` line; the gateway's address."""
        self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        config_file = write_private(self.run_dir.parent, f"{self.name}-config.yaml", self.config.to_yaml())
        argv = spine_up_argv(config_file, self.layout, listen="127.0.0.1:0", http_listen="127.0.0.1:0",
                             run_dir=self.run_dir, extra=self.up_arguments())
        self.launched = launch(self.name, argv, log_path=self.log_path, stdin=self._stdin())
        try:
            ready = self.launched.wait_ready(timeout_s)
        except LaunchFailed as failed:
            self.launched = None
            raise ConfigError(str(failed)) from None
        self.address = str(ready["address"])
        self.http_address = ready.get("http_address")
        return self.address

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM (it stops its children and flushes), then SIGKILL after `grace_s`."""
        launched, self.launched = self.launched, None
        if launched is not None:
            launched.stop(grace_s)

    def _stdin(self) -> bool:
        return False
