"""A cutover's parts start under one stack: what started before a part that fails is stopped.

On the cutover from a foreign HTTP endpoint (`LegacyCutover`: an HTTP front, its comparison
counters on a /metrics of their own, the controller), whose parts are real servers that
start in well under a second and need no spine behind them to start. The controller comes
last; a dashboard asked for on every interface is refused by it (as an operator would meet
it), after the front and the counters already listen. The built-in cutover, whose sides
are processes, is checked the same way in tests/end_to_end/test_cutover_layered_process.py.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import psutil
import pytest

from migration.legacy_endpoint import LegacyEndpoint
from migration.status import State
from migration.traffic.http_mirror import MirrorSettings
from migration.traffic.legacy_cutover import LegacyCutover
from runtime.server import free_port
from services.common import ConfigError
from tests.waiting import eventually

# Nothing listens at either: the front starts without calling them.
LEGACY = LegacyEndpoint("http://127.0.0.1:9/", name="legacy")
SPINE_HTTP = "http://127.0.0.1:9"


def _listening() -> set[int]:
    """The TCP ports this test process listens on."""
    return {c.laddr.port for c in psutil.Process().net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}


def _cutover(run_dir: Path, listen: str, **settings: object) -> LegacyCutover:
    return LegacyCutover(LEGACY, SPINE_HTTP, run_dir, listen=listen, mirror=MirrorSettings(share=0.5),
                         **settings)  # type: ignore[arg-type]


def test_a_controller_that_cannot_start_stops_the_front_and_its_counters_started_before_it(tmp_path: Path) -> None:
    before = _listening()
    port = free_port()
    with pytest.raises(ConfigError, match="dashboard-listen"):
        _cutover(tmp_path, f"127.0.0.1:{port}", dashboard_listen="0.0.0.0:0").start()
    eventually(lambda: _listening() <= before, what="the front and its /metrics stopped listening",
               seen=lambda: _listening() - before)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


def test_a_running_cutover_holds_its_parts_and_stop_stops_every_one(tmp_path: Path) -> None:
    before = _listening()
    with _cutover(tmp_path, "127.0.0.1:0").start() as running:
        assert running.metrics is not None  # the mirror is on: its comparisons are served
        ports = {int(running.address.rsplit(":", 1)[1]), int(running.metrics.address.rsplit(":", 1)[1])}
        assert ports <= _listening() - before
        assert httpx.get(f"http://{running.metrics.address}/metrics", timeout=5).status_code == 200
        assert running.controller.controller.status.state is State.PENDING
        with pytest.raises(AttributeError):  # what runs is what was started: nothing is put in later
            running.front = running.front  # type: ignore[misc]
    eventually(lambda: _listening() <= before, what="every part stopped listening", seen=lambda: _listening() - before)
    running.stop()  # a second stop finds nothing left to stop
