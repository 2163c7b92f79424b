"""Test support for the controller (also for end-to-end tests): a settable clock, small plans."""

from __future__ import annotations

import textwrap

from migration.controller import Controller
from migration.gates import WindowStats
from migration.plan import Plan, load_plan
from migration.recording import RecordingTarget

ADMIN_TOKEN = "test-admin-token-0123456789"
HEALTHY = WindowStats(requests=100, errors=0, p99_ms=10.0)

# Three stages; window 1 s, 5 requests per side per window, hold 2 s each.
THREE_STAGES = textwrap.dedent("""\
    name: three
    window_s: 1
    min_window_requests: 5
    stages:
      - name: logs
        spine_weight: 10
        placements: {logs: local, metrics: local}
        hold_s: 2
        gates:
          - {type: error_rate, max_delta: 0.01}
          - {type: latency_p99_ratio, max_ratio: 1.2}
          - {type: parity, max_mismatches: 0}
      - name: cache
        spine_weight: 50
        placements: {cache: local}
        hold_s: 2
        failure_limit: 2
        gates:
          - {type: error_rate, max_delta: 0.01}
      - name: all
        spine_weight: 100
        manual_approval: true
        placements: {auth: local, ratelimit: local, router: local}
        hold_s: 2
    """)


class FakeClock:
    """Wall-clock seconds that move only when a test says so."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def three_stages() -> Plan:
    return load_plan(THREE_STAGES)


def make_controller(db: str, *, target: RecordingTarget | None = None,
                    clock: FakeClock | None = None) -> tuple[Controller, RecordingTarget, FakeClock]:
    target = target or RecordingTarget(layered=HEALTHY, spine=HEALTHY)
    clock = clock or FakeClock()
    return Controller.open(db, target, clock=clock), target, clock


def run_windows(controller: Controller, clock: FakeClock, count: int, step: float = 1.0) -> None:
    """Tick once (to see the ACK) and then `count` times, `step` seconds apart."""
    controller.tick(clock.now)
    for _ in range(count):
        controller.tick(clock.advance(step))
