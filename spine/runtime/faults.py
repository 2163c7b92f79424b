"""Fault injection for the demo and tests: make one side of a migration misbehave.

A binding hook, so the fault sits exactly where a real one would — on the call into a
component — and is seen by the front's gates like any other failure.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from spine.runtime.local_context import LocalRpcError


@dataclass
class FaultHook:
    """Fail a share of calls to `component` with UNAVAILABLE and/or add latency to them."""

    component: str = "inference"
    error_rate: float = 0.0
    added_latency_s: float = 0.0
    seed: int = 0
    _rng: random.Random = field(init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def begin(self, component: str, method: str, metadata: list[tuple[str, str]]) -> Any:
        if component != self.component:
            return None
        if self.added_latency_s:
            time.sleep(self.added_latency_s)
        with self._lock:
            fail = self._rng.random() < self.error_rate
        if fail:
            raise LocalRpcError(grpc.StatusCode.UNAVAILABLE, f"injected fault in {component}.{method}")
        return None

    def end(self, token: Any, code: grpc.StatusCode) -> None:
        return None

    def clear(self) -> None:
        self.error_rate = 0.0
        self.added_latency_s = 0.0
