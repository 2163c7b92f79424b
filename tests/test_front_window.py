"""The built-in front's window: what the gates read when the front carries the traffic."""

from __future__ import annotations

import time

from migration.traffic.front import Front, Outcome


def test_the_front_times_only_requests_answered_ok() -> None:
    front = Front({"layered": "127.0.0.1:1", "spine": "127.0.0.1:1"})  # never dialled
    try:
        now = time.time()
        front.outcomes.extend([Outcome(now, "spine", False, 1.0, ok=True)] * 90)
        front.outcomes.extend([Outcome(now, "spine", True, 2000.0)] * 5)    # failed by the layout, slowly
        front.outcomes.extend([Outcome(now, "spine", False, 0.05)] * 5)     # refused (e.g. UNAUTHENTICATED)
        spine = front.window(now - 1)["spine"]
    finally:
        front.close()
    assert (spine.requests, spine.errors, spine.ok_requests) == (100, 5, 90)
    assert spine.p99_ms == 1.0
