"""The layered stack as a process tree of its own: `spine up --layout layered`.

Why: when the layered stack's gateway ran in the demo's process, the spine's model shared
one interpreter with the other side's gateway and every request it forwarded, and the
tables compared a spine slowed by the layered side's work with a layered side that had the
machine to itself. Here the layered side is what it is in production: its gateway and every
component in processes of their own (and so is the spine in `make run`: `SpineProcess`).

The spine still shares the layered component processes for whatever it has not collapsed:
their addresses are fixed by the run directory (`<run dir>/<component>.sock`).
"""

from __future__ import annotations

from pathlib import Path

import grpc

from migration.traffic.layout_process import LayoutProcess
from runtime.config.model import SpineConfig
from runtime.placement.remote import remote
from services.ratelimit.api import RATELIMIT, RateLimit
from services.registry import MIDDLEWARES
from wire.v1 import ratelimit_pb2_grpc


class LayeredProcess(LayoutProcess):
    """`spine up --layout layered` on loopback, its run directory `run_dir`; stopped by its PID."""

    name = "layered"
    layout = "layered"

    def __init__(self, config: SpineConfig, run_dir: Path) -> None:
        super().__init__(config, run_dir)
        self._channel: grpc.Channel | None = None

    def component_addresses(self) -> dict[str, str]:
        """Where each layered middleware listens (the spine's remote placements)."""
        return {name: f"unix:{self.run_dir / (name + '.sock')}" for name in MIDDLEWARES}

    def ratelimit(self) -> RateLimit:
        """The layered rate limiter (its share of every limit is set through it)."""
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.component_addresses()["ratelimit"])
        return remote(RATELIMIT, ratelimit_pb2_grpc.RateLimitStub(self._channel), self._channel)

    def stop(self, grace_s: float = 15.0) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        super().stop(grace_s)
