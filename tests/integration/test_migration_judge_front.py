"""The judge driving a controller on real traffic: the HTTP front in front of two real HTTP
servers on loopback (a legacy endpoint, and a spine that fails every fifth request while
told to), the controller judging what the front measured.

The controller's clock is set to the wall clock at each tick (a window then holds exactly
the requests sent since the last one); nothing here depends on how fast the host is: the
latency metric is there, but with `min_shift_ms` far above what two loopback servers
differ by, so only the error counts decide, and they are exact.
"""

from __future__ import annotations

import http.server
import json
import textwrap
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from migration.controller import Controller
from migration.legacy_endpoint import endpoint
from migration.plan import load_plan
from migration.status import State
from migration.testing import FakeClock
from migration.traffic.http_front import HttpFront
from migration.traffic.legacy_target import LegacyTarget
from runtime.config.http import HttpConfig
from runtime.http.server import HttpServer
from tests.waiting import eventually

WINDOW_S = 0.2
ANSWER = json.dumps({"id": "x", "object": "chat.completion", "choices": []}).encode()


class Answering(http.server.ThreadingHTTPServer):
    """A chat endpoint on loopback; with `fail_every`, every n-th request is a 500."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.fail_every = 0
        self.count = 0
        self.lock = threading.Lock()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def failing_now(self) -> bool:
        with self.lock:
            self.count += 1
            return bool(self.fail_every) and self.count % self.fail_every == 0


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    wbufsize = 1 << 16  # the answer in one write (flushed after each request), no Nagle wait per header
    server: Answering

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        self.rfile.read(int(self.headers.get("content-length", "0")))
        status, body = (500, b'{"error": "down"}') if self.server.failing_now() else (200, ANSWER)
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@dataclass
class Rollout:
    controller: Controller
    clock: FakeClock
    spine: Answering
    url: str

    def tick(self) -> None:
        """A tick at the wall clock, at least a window after the last one."""
        started = self.controller.status.window_started_at or 0.0
        self.clock.now = max(time.time(), started + WINDOW_S)
        self.controller.tick(self.clock.now)

    def traffic(self, per_side: int = 150) -> None:
        """`per_side` requests to each side, forced by `x-spine-route`, all ending after the window opened."""
        opened = self.controller.status.window_started_at or 0.0
        eventually(lambda: time.time() > opened, what="the wall clock past the window's start")

        with httpx.Client(timeout=10) as client, ThreadPoolExecutor(8) as pool:
            def send(route: str) -> int:
                return client.post(f"{self.url}/v1/chat/completions", json={"model": "m", "messages": []},
                                   headers={"authorization": "Bearer key-1", "x-spine-route": route}).status_code
            codes = list(pool.map(send, ["legacy", "spine"] * per_side))
        assert set(codes) <= {200, 500}


@pytest.fixture
def rollout(tmp_path: Path) -> Iterator[Rollout]:
    legacy, spine = Answering(), Answering()
    front = HttpFront(endpoint(legacy.url), spine.url)
    server = HttpServer(front, HttpConfig(max_body_bytes=4096), "127.0.0.1:0").start()
    clock = FakeClock(time.time())
    controller = Controller.open(str(tmp_path / "state.db"), LegacyTarget(front), clock=clock)
    plan = textwrap.dedent(f"""\
        name: judged-http
        legacy: {{http: {legacy.url}}}
        window_s: {WINDOW_S}
        min_window_requests: 5
        judge:
          min_samples: 30
          groups:
            - name: latency
              weight: 80
              metrics: [{{name: latency, kind: latency, direction: either, min_shift_ms: 1000}}]
            - {{name: errors, weight: 20, metrics: [{{name: errors, kind: error_rate}}]}}
        stages:
          - {{name: half, spine_weight: 50, hold_s: 0.1}}
          - {{name: all, spine_weight: 100, hold_s: 1}}
        """)
    try:
        controller.start(load_plan(plan), "tester")
        controller.tick(clock.now)  # the front takes the weight at once: the first window opens
        yield Rollout(controller, clock, spine, f"http://{server.address}")
    finally:
        controller.close()
        front.close()
        server.stop(1.0)
        for side in (legacy, spine):
            side.shutdown()
            side.server_close()


def test_a_spine_failing_a_fifth_of_its_requests_scores_marginal_and_holds_then_advances_once_healthy(
        rollout: Rollout) -> None:
    rollout.spine.fail_every = 5
    rollout.traffic()
    rollout.tick()
    status = rollout.controller.status
    assert (status.state, status.stage_index, status.last_verdict) == (State.PROGRESSING, 0, "inconclusive")
    rows = {r.gate: r for r in rollout.controller.store.gate_history(10)}
    assert rows["judge"].value == 80.0 and rows["judge"].message.startswith("marginal: score 80.0")
    assert rows["judge.errors"].verdict == "fail" and rows["judge.errors"].value == pytest.approx(0.2)
    assert rows["judge.latency"].verdict == "pass"  # under min_shift_ms, whatever the host's noise

    rollout.spine.fail_every = 0
    rollout.traffic()
    rollout.tick()
    assert rollout.controller.status.stage_index == 1  # a passing window, the hold long done: next stage
