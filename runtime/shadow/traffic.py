"""Shadow traffic, the way GitHub's Scientist runs an experiment and Diffy measures noise.

A share of live requests is mirrored to another layout after the primary has answered:
the client always gets the primary's answer, and a mirror never delays it (it runs on
its own bounded pool; when that pool is full the mirror is dropped, never queued).
Mirrors carry `x-spine-shadow`, signed with the deployment's internal secret
(`services.pipeline.internal_marks`), so the gateway only dry-runs the rate limit, never
writes the cache, and counts them apart in metrics and logs; a client cannot forge it.

Two parts mirror with this class: the built-in front (`migration.traffic.front`, both
directions) and, where Envoy is the data plane, the spine's own gateway
(`runtime.shadow.gateway_mirror`: the spine's answers against the layered side's).

Each mirrored answer is compared with the primary's (`runtime.shadow.decisions`) and
counted in `counters` (`runtime.shadow.metrics`: the families the parity gate
reads). A mismatch is also published with both sides: in the recent list, and in the log as
a production log should say it (`services.common.log_limit`): each one a DEBUG line with
both answers, and at WARNING at most one line a second per (primary, shadow) pair — "12
shadow mismatches in the last second, first: ..., tokens differ at position 3" — since a
parity fault mismatches every copy. A
share of the mirrors goes to the primary's own side instead — comparing a layout with
itself — and a field that differs there is noise (timing, state a shadow cannot share),
not a verdict on the spine: the gate does not count mismatches in noisy fields. A pair
in which either answer is a layout failure (UNAVAILABLE, ...) is not compared: the
error-rate gate judges failures, and a copy that timed out says nothing about answers.
"""

from __future__ import annotations

import logging
import random
import secrets
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc

from runtime.config.sections import ShadowConfig
from runtime.shadow.decisions import (
    LAYOUT_ERRORS,
    Decision,
    decide,
    differing,
    first_difference,
    root_differences,
)
from runtime.shadow.metrics import ShadowCounters
from services.common.log_limit import RateLimitedLog
from services.common.thread_names import name_os_thread
from services.pipeline.internal_marks import SHADOW_HEADER, shadow_mark
from wire.v1 import generation_pb2

log = logging.getLogger("spine.shadow")

Metadata = tuple[tuple[str, str], ...]
# (target side, request, metadata, timeout_s, stream) -> the target's decision
ShadowCall = Callable[[str, generation_pb2.GenerateRequest, Metadata, float, bool], Decision]


@dataclass(frozen=True)
class Mismatch:
    """One mirrored request whose answer differed, with both sides."""

    at: float                 # time.time(), the clock the migration gates use
    request_id: str
    primary_side: str
    shadow_side: str
    calibration: bool         # the shadow went to the primary's own side
    fields: tuple[str, ...]
    primary: Decision
    shadow: Decision


def other_side(side: str, sides: Sequence[str]) -> str:
    return next(s for s in sides if s != side)


def forward_metadata(metadata: Metadata) -> Metadata:
    """The caller's metadata as a copy may carry it: nothing internal. No `x-spine-*` key a
    client sends reaches a side (the mirror's own mark is signed), nor gRPC's reserved keys."""
    return tuple((k, v) for k, v in metadata if not k.startswith(("x-spine-", "grpc-")))


def gateway_call(stubs: Mapping[str, Any]) -> ShadowCall:
    """A `ShadowCall` over Gateway stubs, one per side; a failed call is the decision it got."""

    def call(target: str, request: generation_pb2.GenerateRequest, metadata: Metadata, timeout_s: float,
             stream: bool) -> Decision:
        try:
            if stream:
                chunks = list(stubs[target].GenerateStream(request, timeout=timeout_s, metadata=metadata))
                return decide(request, grpc.StatusCode.OK, chunks=chunks)
            response = stubs[target].Generate(request, timeout=timeout_s, metadata=metadata)
            return decide(request, grpc.StatusCode.OK, response=response)
        except grpc.RpcError as error:
            return decide(request, error.code(), error.details() or "")

    return call


class ShadowMirror:
    """Mirrors, compares and counts; the front or the spine's gateway offers it every answered request.

    `primaries`: the sides whose answers are offered (the front: both; the spine: itself),
    so the counters show the mirror is on before its first comparison.
    """

    def __init__(self, config: ShadowConfig, call: ShadowCall, sides: Sequence[str] = ("layered", "spine"), *,
                 key: bytes, clock: Callable[[], float] = time.time, rng: random.Random | None = None,
                 history: int = 10_000, primaries: Sequence[str] | None = None) -> None:
        self.config = config
        self.key = key  # the deployment's internal secret: signs each copy's shadow mark
        self.sides = tuple(sides)
        self._call = call
        self._clock = clock
        self._rng = rng or random.Random()
        self._slots = threading.BoundedSemaphore(config.max_in_flight)
        self._pool = ThreadPoolExecutor(max_workers=config.max_in_flight, thread_name_prefix="shadow",
                                        initializer=name_os_thread)
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.noise: Counter[str] = Counter()      # field -> mismatches of a layout with itself
        self.mismatches: deque[Mismatch] = deque(maxlen=history)
        self.counters = ShadowCounters()
        self.counters.expect((primary, other_side(primary, self.sides)) for primary in (primaries or self.sides))
        self.share = config.share
        self._closed = False
        # Mismatches are what a parity fault produces for every copy: one line each at DEBUG,
        # at most one a second per (primary, shadow) pair at WARNING; every one is counted
        # in `counters` (spine_shadow_mismatched_total).
        self._mismatch_log = RateLimitedLog(log, "shadow mismatches")
        self._failure_log = RateLimitedLog(log, "failed shadow calls")

    # -- the request path: must stay cheap ------------------------------------------
    def set_share(self, share: float) -> None:
        """The share of answers mirrored from now on (a ramp, as in Scientist)."""
        self.share = share

    def offer(self, primary_side: str, request: generation_pb2.GenerateRequest, metadata: Metadata,
              primary: Decision | Callable[[], Decision], *, stream: bool = False, request_id: str = "") -> bool:
        """Maybe mirror this answered request; True when a mirror was started.

        `primary` may be a callable that makes the decision: only called for a request
        that is mirrored."""
        if self._closed or self.share <= 0.0 or self._rng.random() >= self.share:
            return False
        calibration = self._rng.random() < self.config.calibration_share
        target = primary_side if calibration else other_side(primary_side, self.sides)
        if not self._slots.acquire(blocking=False):
            with self._lock:
                self.counts["dropped"] += 1
            self.counters.skipped(primary_side, target, calibration, "saturated")
            return False
        with self._lock:
            self.counts["mirrored"] += 1
        decision = primary() if callable(primary) else primary
        request_id = request_id or f"shadow-{secrets.token_hex(8)}"
        shadow_md = tuple((k, v) for k, v in metadata if k not in (SHADOW_HEADER, "x-request-id")) + (
            ("x-request-id", request_id), (SHADOW_HEADER, shadow_mark(self.key, request_id)))
        try:
            self._pool.submit(self._mirror, primary_side, target, calibration, request, shadow_md, decision,
                              stream, request_id)
        except RuntimeError:  # closed meanwhile
            self._slots.release()
            return False
        return True

    # -- off the request path ---------------------------------------------------------
    def _mirror(self, primary_side: str, target: str, calibration: bool, request: generation_pb2.GenerateRequest,
                metadata: Metadata, primary: Decision, stream: bool, request_id: str) -> None:
        try:
            shadow = self._call(target, request, metadata, self.config.timeout_s, stream)
        except Exception as error:  # a broken shadow must never reach a client
            with self._lock:
                self.counts["errors"] += 1
            self.counters.skipped(primary_side, target, calibration, "call_failed")
            self._failure_log(target, "shadow call to %s failed: %s", target, error)
            return
        finally:
            self._slots.release()
        if self.config.compare:
            self.compare(primary_side, target, primary, shadow, calibration=calibration, request_id=request_id)

    def compare(self, primary_side: str, shadow_side: str, primary: Decision, shadow: Decision, *,
                calibration: bool = False, request_id: str = "") -> Mismatch | None:
        """Compare one pair of answers, count it, publish a mismatch."""
        if primary.status in LAYOUT_ERRORS or shadow.status in LAYOUT_ERRORS:
            with self._lock:
                self.counts["layout_errors"] += 1
            self.counters.skipped(primary_side, shadow_side, calibration, "layout_error")
            return None
        fields = root_differences(primary, shadow, self.config.ignore_fields)
        self.counters.compared(primary_side, shadow_side, calibration, fields)
        with self._lock:
            self.counts["calibration_compared" if calibration else "compared"] += 1
            if calibration:
                self.noise.update(fields)
            if not fields:
                return None
            self.counts["calibration_mismatched" if calibration else "mismatched"] += 1
            mismatch = Mismatch(self._clock(), request_id, primary_side, shadow_side, calibration, fields,
                                primary, shadow)
            self.mismatches.append(mismatch)
        self._mismatch_log((primary_side, shadow_side, calibration), "shadow mismatch%s on %s: request %s, %s",
                           " (calibration, same layout)" if calibration else "", ", ".join(fields),
                           request_id or "-", first_difference(fields[0], primary, shadow, primary_side, shadow_side),
                           detail=lambda: _detail(mismatch, self.config.ignore_fields))
        return mismatch

    # -- what reports read (the gates read `counters`, through a metrics source) --------
    def noisy_fields(self) -> frozenset[str]:
        """Fields on which a layout has disagreed with itself."""
        with self._lock:
            return frozenset(name for name, count in self.noise.items() if count)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            counts = dict(self.counts)
            noise = dict(self.noise)
        compared = counts.get("compared", 0)
        calibrated = counts.get("calibration_compared", 0)
        return {
            "share": self.share, "counts": counts, "noise_fields": noise,
            "mismatch_rate": counts.get("mismatched", 0) / compared if compared else 0.0,
            "baseline_mismatch_rate": counts.get("calibration_mismatched", 0) / calibrated if calibrated else 0.0,
        }

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        """True once no mirror is in flight (tests, orderly shutdown)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            taken = 0
            while taken < self.config.max_in_flight and self._slots.acquire(blocking=False):
                taken += 1
            for _ in range(taken):
                self._slots.release()
            if taken == self.config.max_in_flight:
                return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._mismatch_log.flush()
        self._failure_log.flush()


def _detail(mismatch: Mismatch, ignore: Sequence[str]) -> str:
    """The whole mismatch in one line: every field that differs, as each side had it."""
    shown = differing(mismatch.primary, mismatch.shadow, ignore)  # the consequences too
    return (f"shadow mismatch{' (calibration, same layout)' if mismatch.calibration else ''} on "
            f"{', '.join(mismatch.fields)}: request {mismatch.request_id or '-'}, {mismatch.primary_side} said "
            f"{_brief(mismatch.primary, shown)}; {mismatch.shadow_side} said {_brief(mismatch.shadow, shown)}")


def _brief(decision: Decision, fields: Sequence[str]) -> str:
    return "{" + ", ".join(f"{name}={getattr(decision, name)!r}" for name in fields) + "}"
