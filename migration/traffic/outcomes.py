"""What a front measured per side: each request's end, failure and latency, and its windows.

Both fronts keep one (`migration.traffic.front` for the Gateway API, `migration.traffic.http_front`
for the HTTP APIs in front of a foreign legacy endpoint): the gates judge each side from what
the front saw, which is all there is where a side has no metrics of its own.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

from runtime.observability.stats import percentile

SIDES = ("layered", "spine")


@dataclass(frozen=True)
class Outcome:
    ended_at: float  # time.time()
    side: str
    failed: bool
    latency_ms: float
    ok: bool = False  # answered OK: only these are timed for the latency gate
    model: bool = False  # answered OK by the model (not from the response cache)
    in_flight: int = 0  # requests in flight on this side when it started, itself included (0: never sent)


@dataclass(frozen=True)
class SideWindow:
    requests: int
    errors: int
    p99_ms: float  # over the requests answered OK (like for like), 0 when none
    ok_requests: int
    # Like for like (the demo's table; the gates read the fields above): over the requests
    # the model answered OK, their p50 and p99 (0 when none), how many, and the mean number
    # of requests in flight on this side when each of them started.
    p50_model_ms: float = 0.0
    p99_model_ms: float = 0.0
    model_requests: int = 0
    mean_in_flight: float = 0.0
    p50_ms: float = 0.0  # over the requests answered OK, like p99_ms (0 when none)
    # Each of those requests' latency: the samples the judge compares (`migration.judge`).
    ok_latencies_ms: tuple[float, ...] = field(default=(), repr=False, compare=False)


class OutcomeLog:
    """The last `history` outcomes and the requests in flight per side, under one lock."""

    def __init__(self, history: int = 100_000) -> None:
        self.outcomes: deque[Outcome] = deque(maxlen=history)
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = dict.fromkeys(SIDES, 0)

    def enter(self, side: str) -> int:
        """Count a request in flight on `side`; how many are, itself included."""
        with self._lock:
            self._in_flight[side] += 1
            return self._in_flight[side]

    def leave(self, side: str) -> None:
        with self._lock:
            self._in_flight[side] -= 1

    def in_flight(self) -> dict[str, int]:
        """The requests in flight on each side now."""
        with self._lock:
            return dict(self._in_flight)

    def add(self, outcome: Outcome) -> None:
        with self._lock:
            self.outcomes.append(outcome)

    def window(self, since: float, until: float | None = None) -> dict[str, SideWindow]:
        """Per side, for requests ended since `since` (and before `until`, when given): requests, layout errors and the OK
        requests' p99 latency (what the gates read); and over the requests the model answered
        OK, their p50 and p99, count and mean in-flight concurrency (what the demo compares)."""
        with self._lock:
            recent = [o for o in self.outcomes if o.ended_at >= since and (until is None or o.ended_at < until)]
        result = {}
        for side in SIDES:
            mine = [o for o in recent if o.side == side]
            latencies = [o.latency_ms for o in mine if o.ok]
            served = [o for o in mine if o.model]
            model_ms = [o.latency_ms for o in served]
            result[side] = SideWindow(len(mine), sum(o.failed for o in mine),
                                      percentile(latencies, 99) if latencies else 0.0, len(latencies),
                                      p50_model_ms=percentile(model_ms, 50) if served else 0.0,
                                      p99_model_ms=percentile(model_ms, 99) if served else 0.0,
                                      model_requests=len(served),
                                      mean_in_flight=sum(o.in_flight for o in served) / len(served) if served else 0.0,
                                      p50_ms=percentile(latencies, 50) if latencies else 0.0,
                                      ok_latencies_ms=tuple(latencies))
        return result
