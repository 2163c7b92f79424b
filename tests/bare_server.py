"""A real bare model server (`spine up --layout bare`) for tests: the upstream that gateways call."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from runtime.processes.launch import Launched, launch

BARE_KEY = "bare-upstream-key-0000"


@dataclass
class BareUpstream:
    """A running bare server: its addresses and the key it wants."""

    launched: Launched
    address: str  # gRPC
    http_address: str
    key: str | None

    @property
    def base_url(self) -> str:
        """What the openai SDK (and an `upstream.base_url`) takes."""
        return f"http://{self.http_address}/v1"


@contextlib.contextmanager
def bare_upstream(tmp: Path, *, key: str | None = BARE_KEY, config: Path | None = None,
                  extra: tuple[str, ...] = ()) -> Iterator[BareUpstream]:
    """`spine up --layout bare` on free loopback ports, its key from the environment."""
    env = {k: v for k, v in os.environ.items() if k != "SPINE_API_KEY"}
    if key is not None:
        env["SPINE_API_KEY"] = key
    configured = ["--config", str(config)] if config is not None else []
    argv = [sys.executable, "-m", "spine", *configured, "up", "--layout", "bare", "--listen", "127.0.0.1:0",
            "--http-listen", "127.0.0.1:0", "--run-dir", str(tmp / "bare-run"), *extra]
    launched = launch("spine up bare", argv, log_path=tmp / "bare.log", env=env)
    try:
        ready = launched.wait_ready(120)
        yield BareUpstream(launched, ready["address"], ready["http_address"], key)
    finally:
        launched.stop()
