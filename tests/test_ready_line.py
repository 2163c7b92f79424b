"""Waiting for a child's `ready` line: found past other output, a `failed` event, an exit, a deadline."""

from __future__ import annotations

import subprocess
import sys
import time

from runtime.ready_line import first_event


def _first_event(code: str, timeout_s: float = 10.0) -> tuple[dict | None, float]:
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    started = time.monotonic()
    try:
        return first_event(process, started + timeout_s), time.monotonic() - started
    finally:
        process.kill()
        process.wait()


def test_the_ready_event_is_found_after_other_lines() -> None:
    event, _ = _first_event('print("starting"); print("[1, 2]"); '
                            'print(\'{"event": "ready", "address": "unix:/x"}\', flush=True); '
                            'import time; time.sleep(30)')
    assert event == {"event": "ready", "address": "unix:/x"}


def test_a_failed_event_is_returned_for_the_caller_to_report() -> None:
    event, _ = _first_event('print(\'{"event": "failed", "error": "no model"}\', flush=True); '
                            'import time; time.sleep(30)')
    assert event == {"event": "failed", "error": "no model"}


def test_an_exit_before_any_event_returns_none_at_once() -> None:
    event, waited = _first_event("import sys; sys.exit(2)")
    assert event is None and waited < 5


def test_a_silent_child_returns_none_at_the_deadline() -> None:
    event, waited = _first_event("import time; time.sleep(30)", timeout_s=0.5)
    assert event is None and 0.5 <= waited < 3
