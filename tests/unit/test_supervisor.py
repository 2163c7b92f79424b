"""The supervisor restarts a crashing child with exponential backoff, never waits under its
lock, and reports a crash loop until the child has stayed up. A real child process, made to
crash by a config it refuses (as a bad deploy would)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from runtime.processes.supervisor import Supervisor
from tests.conftest import config_for_tests
from tests.waiting import ShiftedClock, eventually


def seconds_until(condition: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> float:
    """The seconds `condition` took to hold (`eventually`: fails after `timeout`)."""
    started = time.monotonic()
    eventually(condition, timeout, what, interval=0.05)
    return time.monotonic() - started


@contextlib.contextmanager
def refused_config(path: Path) -> Iterator[None]:
    """Every child started meanwhile exits at once: the config has an unknown section (as a
    bad deploy would)."""
    text = path.read_text()
    path.write_text(text + "\nnot_a_section: {}\n")
    try:
        yield
    finally:
        path.write_text(text)


def test_the_backoff_doubles_up_to_its_cap() -> None:
    supervisor = Supervisor(Path("/nonexistent"), restart_backoff=0.2, max_restart_backoff=10.0)
    assert [supervisor.backoff(n) for n in range(1, 9)] == [0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 10.0, 10.0]


def test_a_crashing_child_is_restarted_with_growing_delays_and_reported_as_a_crash_loop(tmp_path: Path) -> None:
    config_path = tmp_path / "config.yaml"
    config_path.write_text(config_for_tests().to_yaml())
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    clock = ShiftedClock()
    supervisor = Supervisor(run_dir, restart_backoff=0.25, max_restart_backoff=1.0, stable_after_s=1.0,
                            crash_loop_after=3, clock=clock)
    child = supervisor.add_component("auth", config_path)
    supervisor.start()
    try:
        clock.advance(1.1)  # up for longer than stable_after_s: its first exit starts the backoff over
        slowest_status_s = 0.0
        with refused_config(config_path):
            assert child.pid is not None
            os.kill(child.pid, signal.SIGKILL)

            def five_exits() -> bool:
                nonlocal slowest_status_s
                started = time.monotonic()
                supervisor.status()  # takes the lock: never waits behind a backoff
                slowest_status_s = max(slowest_status_s, time.monotonic() - started)
                return len(child.exits) >= 5

            seconds_until(five_exits, timeout=120, what="five exits")
            status = supervisor.status()["auth"]
            assert status["state"] == "crash_loop" and status["exits_in_a_row"] >= 5
            assert status["last_exit_code"] not in (0, None)
            assert supervisor.down_reason("auth") is not None and "crash loop" in str(supervisor.down_reason("auth"))
            exits = list(child.exits)[:5]
        delays = [e.delay_s for e in exits]
        gaps = [later.started_at - earlier.exited_at for earlier, later in zip(exits, exits[1:], strict=False)]
        print(f"\nbackoff: delays {delays}, measured gaps {[round(g, 2) for g in gaps]}, "
              f"slowest status() {slowest_status_s * 1000:.1f} ms")
        assert delays == [0.25, 0.5, 1.0, 1.0, 1.0]
        assert all(gap >= delay for gap, delay in zip(gaps, delays, strict=False))
        assert slowest_status_s < 0.5  # a backoff of up to 1 s never held the lock
        # The config is fixed: the child comes back, and after stable_after_s the loop is over.
        seconds_until(lambda: supervisor.status()["auth"]["state"] == "serving", timeout=60,
                      what="serving and out of the crash loop")
        assert supervisor.down_reason("auth") is None and supervisor.status()["auth"]["exits_in_a_row"] == 0
        # A child that stayed up starts its backoff over.
        clock.advance(1.1)
        count = len(child.exits)
        assert child.pid is not None
        os.kill(child.pid, signal.SIGKILL)
        seconds_until(lambda: len(child.exits) > count, what="the exit noticed")
        assert child.exits[-1].delay_s == 0.25
        seconds_until(lambda: supervisor.ready() == {"auth": True}, what="restarted")
    finally:
        supervisor.stop()
