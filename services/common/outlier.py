"""Outlier ejection for a component in another process, or an upstream server: fail fast
instead of waiting on it.

Envoy's consecutive-failure outlier detection, for one remote component: after
`consecutive_failures` calls in a row fail (the component unreachable, crashing, or slower
than its call budget), it is ejected — calls fail at once with UNAVAILABLE — for a cooldown;
then one call at a time is let through as a probe (half-open). A probe that succeeds puts
the component back; one that fails ejects it again for twice as long, up to a cap.

What counts as a failure is the component's fault, never the client's: a component's own
verdict (UNAUTHENTICATED, NOT_FOUND, RESOURCE_EXHAUSTED...) is an answer, and a deadline
counts only when the call had the component's whole budget (a client that sends a 10 ms
deadline must not be able to eject a healthy component).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import grpc

log = logging.getLogger("spine.outlier")
# (In `services` so that both the bindings (runtime) and the inference component's upstream
# models (`services.inference.upstream`) eject the same way.)

# Failures of the component or of the link to it, as opposed to its verdicts.
FAILURE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
                           grpc.StatusCode.DATA_LOSS, grpc.StatusCode.UNIMPLEMENTED})


@dataclass(frozen=True)
class OutlierPolicy:
    consecutive_failures: int = 5
    ejection_s: float = 1.0  # the first cooldown; doubles while probes keep failing
    max_ejection_s: float = 30.0


class Ejection(StrEnum):
    IN = "in"  # calls go through
    OUT = "out"  # ejected: calls fail at once until the cooldown ends
    PROBING = "probing"  # one call is out as a probe; the others fail at once


class Ejected(grpc.RpcError):
    """The call was not made: the component is ejected. UNAVAILABLE, as the wire would say."""

    ejected = True  # read (by name) by the pipeline, which counts the request as ejected

    def __init__(self, details: str) -> None:
        super().__init__(details)
        self._details = details

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Any:
        return ()


class OutlierDetector:
    """The ejection state of one remote component, shared by every call to it."""

    def __init__(self, component: str, policy: OutlierPolicy, budget_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.component = component
        self.policy = policy
        self.budget_s = budget_s
        self._clock = clock
        self._lock = threading.Lock()
        self.state = Ejection.IN
        self.consecutive = 0
        self.ejections = 0  # how many times it was ejected
        self._cooldown_s = policy.ejection_s
        self._until = 0.0
        self.not_serving = ""  # why its health check says it cannot serve ("" while it can)

    def set_health(self, serving: bool, reason: str) -> None:
        """The gateway's health watcher's view: while the component is not serving (dead,
        stopped, in a crash loop), calls fail at once; the watcher's own checks probe it."""
        self.not_serving = "" if serving else (reason or "not serving")
        if serving:
            with self._lock:  # its health answered: as good a probe as any
                if self.state != Ejection.IN:
                    log.warning("%s readmitted: its health check answers SERVING", self.component)
                self.state = Ejection.IN
                self.consecutive = 0
                self._cooldown_s = self.policy.ejection_s

    def admit(self) -> None:
        """Before a call: raise `Ejected` when the call must not be made."""
        down = self.not_serving
        if down:
            raise Ejected(f"{self.component} is not serving ({down})")
        with self._lock:
            if self.state == Ejection.IN:
                return
            now = self._clock()
            if self.state == Ejection.OUT and now >= self._until:
                self.state = Ejection.PROBING  # this call is the probe
                return
            left = max(0.0, self._until - now)
            wait = f"next probe in {left:.1f}s" if self.state == Ejection.OUT else "a probe is in flight"
            raise Ejected(f"{self.component} ejected after {self.consecutive} consecutive failures ({wait})")

    def record(self, code: grpc.StatusCode, timeout_s: float | None) -> None:
        """After a call: its status, and the timeout it was given."""
        failed = code in FAILURE_CODES or (
            code == grpc.StatusCode.DEADLINE_EXCEEDED and timeout_s is not None
            and timeout_s >= self.budget_s * 0.999)
        with self._lock:
            if failed:
                self.consecutive += 1
                if self.state == Ejection.PROBING:
                    self._eject(min(self._cooldown_s * 2, self.policy.max_ejection_s), "its probe failed")
                elif self.state == Ejection.IN and self.consecutive >= self.policy.consecutive_failures:
                    self._eject(self.policy.ejection_s, f"{self.consecutive} consecutive failures ({code.name})")
            elif code != grpc.StatusCode.DEADLINE_EXCEEDED:  # an answer: the component is back
                if self.state != Ejection.IN:
                    log.warning("%s readmitted: a probe succeeded after %d failures", self.component,
                                self.consecutive)
                self.state = Ejection.IN
                self.consecutive = 0
                self._cooldown_s = self.policy.ejection_s
            elif self.state == Ejection.PROBING:  # the client's deadline ended the probe: no verdict
                self._eject(self._cooldown_s, "its probe ran out of the client's time")

    def _eject(self, cooldown_s: float, why: str) -> None:
        self.state = Ejection.OUT
        self._cooldown_s = cooldown_s
        self._until = self._clock() + cooldown_s
        self.ejections += 1
        log.warning("%s ejected for %.1fs: %s; calls fail fast meanwhile", self.component, cooldown_s, why)
