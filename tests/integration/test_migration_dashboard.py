"""The controller's dashboard over HTTP: the page, its live events, who may read and who may act."""

from __future__ import annotations

import http.client
import json
import shutil
import ssl
import tempfile
import textwrap
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from migration.gates import WindowStats
from migration.plan import load_plan
from migration.recording import RecordingTarget
from migration.server import ControllerProcess
from migration.testing import ADMIN_TOKEN, HEALTHY
from runtime.config.sections import TlsConfig
from services.common import ConfigError
from tests.tls_helpers import make_certs
from tests.waiting import eventually

# Two stages a few ticks long each; the second waits for an operator where a test says so.
PLAN = textwrap.dedent("""\
    name: dash
    window_s: 0.1
    min_window_requests: 5
    stages:
      - {name: first-stage, spine_weight: 10, placements: {logs: local}, hold_s: 0.2,
         gates: [{type: error_rate, max_delta: 0.01}]}
      - {name: second-stage, spine_weight: 100, placements: {auth: local}, hold_s: 60}
    """)


class Dashboard:
    def __init__(self, tmp: Path, sockets: str, **options: Any) -> None:
        self.target = RecordingTarget(layered=HEALTHY, spine=HEALTHY)
        self.process = ControllerProcess(str(tmp / "m.db"), f"unix:{sockets}/c.sock", ADMIN_TOKEN, self.target,
                                         tick_s=0.02, dashboard_listen="127.0.0.1:0", **options)
        self.process.start()
        assert self.process.dashboard_url is not None
        self.url = self.process.dashboard_url
        self.controller = self.process.controller

    def request(self, method: str, path: str, token: str | None = None, body: dict[str, Any] | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, Any]:
        sent = dict(headers or {})
        if token is not None:
            sent["Authorization"] = f"Bearer {token}"
        data = json.dumps(body).encode() if body is not None else None
        if data is not None:
            sent["Content-Type"] = "application/json"
        request = urllib.request.Request(self.url + path.lstrip("/"), data=data, method=method, headers=sent)
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                raw = answer.read()
                code = answer.status
        except urllib.error.HTTPError as error:
            raw, code = error.read(), error.code
        try:
            return code, json.loads(raw)
        except ValueError:
            return code, raw.decode()


@pytest.fixture
def make_dashboard(tmp_path) -> Iterator[Any]:
    sockets = tempfile.mkdtemp(prefix="dash", dir="/tmp")
    started: list[Dashboard] = []

    def make(**options: Any) -> Dashboard:
        folder = tmp_path / f"dashboard-{len(started)}"
        folder.mkdir()
        started.append(Dashboard(folder, sockets, **options))
        return started[-1]

    try:
        yield make
    finally:
        for dashboard in started:
            dashboard.process.stop(grace=0.2)
        shutil.rmtree(sockets, ignore_errors=True)


def events(url: str, token: str | None = None) -> Iterator[dict[str, Any]]:
    """The /api/events stream's states, one by one."""
    request = urllib.request.Request(url + "api/events",
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=10) as stream:
        for line in stream:
            if line.startswith(b"data: "):
                yield json.loads(line[len(b"data: "):])


def test_the_page_names_the_plans_stages(make_dashboard):
    dashboard = make_dashboard(view_without_token=True)
    dashboard.controller.start(load_plan(PLAN), "test")
    code, page = dashboard.request("GET", "/")
    assert code == 200
    assert "first-stage" in page and "second-stage" in page and "dashboard.js" in page


def test_the_event_stream_carries_the_new_stage_soon_after_a_transition(make_dashboard):
    dashboard = make_dashboard(view_without_token=True)
    dashboard.controller.start(load_plan(PLAN.replace("hold_s: 0.2", "hold_s: 60")), "test")
    stream = events(dashboard.url)
    assert next(stream)["status"]["stage_name"] == "first-stage"
    dashboard.controller.advance("second-stage", "test")
    # Woken by the transition itself (heartbeats, one a second, may already be on their way).
    for _ in range(10):
        state = next(stream)
        if state["status"]["stage_name"] == "second-stage":
            break
    assert state["status"]["stage_name"] == "second-stage"
    assert state["status"]["recent_audit"][-1]["action"] == "advance"


def test_a_transition_is_pushed_at_once_not_at_the_next_heartbeat(make_dashboard):
    dashboard = make_dashboard(view_without_token=True)
    assert dashboard.process.dashboard is not None
    dashboard.process.dashboard.heartbeat_s = 3600.0  # no heartbeat during this test
    dashboard.controller.start(load_plan(PLAN.replace("hold_s: 0.2", "hold_s: 60")), "test")
    stream = events(dashboard.url)
    assert next(stream)["status"]["stage_name"] == "first-stage"
    dashboard.controller.advance("second-stage", "test")
    assert next(stream)["status"]["stage_name"] == "second-stage"


def test_state_holds_gate_history_layouts_and_audit(make_dashboard):
    dashboard = make_dashboard(view_without_token=True)
    dashboard.target.spine = WindowStats(requests=100, errors=0, p99_ms=12.0, p50_ms=4.0)
    dashboard.controller.start(load_plan(PLAN), "test")
    for state in events(dashboard.url):
        if state["status"]["stage_name"] == "second-stage":
            break
    code, state = dashboard.request("GET", "/api/state")
    assert code == 200
    assert [s["name"] for s in state["plan"]["stages"]] == ["first-stage", "second-stage"]
    gate = [g for g in state["gate_history"] if g["stage"] == "first-stage"][-1]
    assert (gate["gate"], gate["verdict"], gate["threshold"]) == ("error_rate", "pass", 0.01)
    assert state["layouts"]["latest"]["spine"]["p50_ms"] == 4.0
    assert state["layouts"]["latest"]["spine"]["p99_ms"] == 12.0
    assert [row["action"] for row in state["status"]["recent_audit"]][:2] == ["start", "advance"]


def test_reading_needs_the_admin_token_unless_the_operator_allowed_viewing(make_dashboard):
    closed = make_dashboard()
    for path in ("/api/state", "/api/events", "/metrics"):
        assert closed.request("GET", path)[0] == 401
        assert closed.request("GET", path, token="not-the-admin-token-at-all")[0] == 401
    assert closed.request("GET", "/api/state", token=ADMIN_TOKEN)[0] == 200
    code, page = closed.request("GET", "/")
    assert code == 200 and "<!--STAGES-->" in page  # no plan data in the page without the token
    opened = make_dashboard(view_without_token=True)
    assert opened.request("GET", "/api/state")[0] == 200


def test_a_button_without_the_token_is_refused_and_changes_nothing(make_dashboard):
    dashboard = make_dashboard(view_without_token=True)
    dashboard.controller.start(load_plan(PLAN.replace("hold_s: 0.2", "hold_s: 60")), "test")
    code, answer = dashboard.request("POST", "/api/commands/pause", body={"actor": "mallory"})
    assert code == 401 and "admin token" in answer["error"]
    code, _ = dashboard.request("POST", "/api/commands/rollback", token="wrong-token-0123456789", body={})
    assert code == 401
    assert dashboard.controller.status.state == "progressing"
    assert [row.action for row in dashboard.controller.store.audit()] == ["start"]


def test_a_button_with_the_token_runs_the_command_and_the_audit_says_who(make_dashboard):
    dashboard = make_dashboard()
    dashboard.controller.start(load_plan(PLAN.replace("hold_s: 0.2", "hold_s: 60")), "test")
    code, answer = dashboard.request("POST", "/api/commands/pause", token=ADMIN_TOKEN,
                                     body={"actor": "alice", "reason": "looking at p99"})
    assert code == 200 and answer["state"]["status"]["state"] == "paused"
    row = dashboard.controller.store.audit()[-1]
    assert (row.action, row.reason) == ("pause", "looking at p99")
    assert row.actor == "alice@dashboard(127.0.0.1)"
    code, _ = dashboard.request("POST", "/api/commands/advance", token=ADMIN_TOKEN, body={"stage": "second-stage"})
    assert code == 200 and dashboard.controller.status.stage_index == 1


def test_a_command_the_state_refuses_answers_409_with_the_reason(make_dashboard):
    dashboard = make_dashboard()
    dashboard.controller.start(load_plan(PLAN.replace("hold_s: 0.2", "hold_s: 60")), "test")
    code, answer = dashboard.request("POST", "/api/commands/approve", token=ADMIN_TOKEN, body={})
    assert code == 409 and "nothing awaits approval" in answer["error"]
    assert dashboard.request("POST", "/api/commands/abort", token=ADMIN_TOKEN, body={})[0] == 404


def test_a_foreign_host_name_is_refused_on_loopback(make_dashboard):
    dashboard = make_dashboard(view_without_token=True)
    code, answer = dashboard.request("GET", "/api/state", headers={"Host": "attacker.example:80"})
    assert code == 421 and "loopback" in answer["error"]


def test_the_dashboard_speaks_tls_with_the_controllers_certificate(tmp_path, make_dashboard):
    certs = make_certs(tmp_path / "certs")
    tls = TlsConfig(cert_file=str(certs.server), key_file=str(certs.server_key))
    dashboard = make_dashboard(tls=tls, view_without_token=True)
    assert dashboard.url.startswith("https://")
    host, port = dashboard.url.removeprefix("https://").rstrip("/").rsplit(":", 1)
    context = ssl.create_default_context(cafile=str(certs.ca))
    context.check_hostname = False
    connection = http.client.HTTPSConnection(host, int(port), context=context, timeout=10)
    connection.request("GET", "/api/state")
    assert connection.getresponse().status == 200
    plain = http.client.HTTPConnection(host, int(port), timeout=10)
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        plain.request("GET", "/api/state")
        plain.getresponse()


def test_the_dashboard_listens_where_a_browser_can_reach_and_only_on_loopback(tmp_path):
    for listen, says in (("unix:/tmp/x.sock", "HOST:PORT"), ("10.1.2.3:8470", "loopback")):
        with pytest.raises(ConfigError, match=says):
            ControllerProcess(str(tmp_path / "m.db"), "127.0.0.1:0", ADMIN_TOKEN, RecordingTarget(),
                              dashboard_listen=listen)


def test_metrics_count_transitions_from_the_audit_trail(make_dashboard):
    dashboard = make_dashboard()
    dashboard.controller.start(load_plan(PLAN.replace("hold_s: 0.2", "hold_s: 60")), "test")
    dashboard.controller.rollback("test")
    code, text = dashboard.request("GET", "/metrics", token=ADMIN_TOKEN)
    assert code == 200
    assert 'spine_migration_transitions_total{to_state="rolled_back"} 1.0' in text
    assert 'spine_migration_transitions_total{to_state="promoted"} 0.0' in text
    assert 'spine_migration_state{plan="dash",state="rolled_back"} 1.0' in text


def test_layouts_come_from_the_targets_reading_and_say_why_when_it_fails():
    from migration.dashboard.document import LayoutSampler
    from migration.gates import ParityStats

    class GatesOnly:  # a target with only the gates' reading
        def window_stats(self, since: float) -> tuple[WindowStats, WindowStats, ParityStats]:
            return (WindowStats(50, 5, 20.0), WindowStats(30, 0, 10.0, p50_ms=3.0), ParityStats(0, 0))

    class Broken:
        def layout_stats(self, since: float) -> tuple[WindowStats, WindowStats]:
            raise TimeoutError("prometheus did not answer")

    sides = LayoutSampler(GatesOnly()).latest().sides
    assert (sides["layered"]["error_rate"], sides["layered"]["rps"]) == (0.1, 5.0)
    assert (sides["spine"]["p50_ms"], sides["spine"]["p99_ms"]) == (3.0, 10.0)
    broken = LayoutSampler(Broken()).latest().sides
    assert broken["spine"]["missing"] == "TimeoutError: prometheus did not answer"
    assert broken["spine"]["p99_ms"] is None and broken["spine"]["error_rate"] is None


def test_every_runs_outcome_stays_on_the_page_after_the_next_one(make_dashboard):
    """The demo walks its plan three times; a person who opens the page after the last one
    sees each run's outcome and why, read back from the audit trail."""
    dashboard = make_dashboard(view_without_token=True)
    plan = load_plan(PLAN.replace("hold_s: 60", "hold_s: 0.2"))
    controller = dashboard.controller
    controller.start(plan, "demo", "healthy spine")
    eventually(lambda: controller.status.state == "promoted", what="the healthy spine promoted",
               seen=lambda: controller.status.state)
    controller.start(plan, "demo", "failing spine")
    controller.rollback("operator", "the spine fails half its calls")
    controller.start(plan, "demo", "spine answering differently")
    controller.abort("operator", "seen enough")
    code, state = dashboard.request("GET", "/api/state")
    assert code == 200
    runs = [(r["title"], r["actor"], r["state"], r["why"]) for r in state["runs"]]
    assert runs[0][:3] == ("healthy spine", "demo", "promoted") and "gates passing" in runs[0][3]
    assert runs[1:] == [("failing spine", "demo", "rolled_back", "the spine fails half its calls"),
                        ("spine answering differently", "demo", "aborted", "seen enough")]
    assert all(r["ended_at"] is not None and r["ended_at"] >= r["started_at"] for r in state["runs"])


def test_a_flood_of_refused_admin_tokens_is_one_warning_a_second(make_dashboard):
    from migration.dashboard import server
    from tests.log_lines import LogLines, assert_summarized

    dashboard = make_dashboard()
    with LogLines("spine.migration.dashboard", server._refused_tokens) as lines:
        for _ in range(40):
            assert dashboard.request("GET", "/api/state", token="a-guess-0123456789")[0] == 401
        assert_summarized(lines, server._refused_tokens, 40, containing="admin token not accepted")


def test_the_judges_score_and_each_metrics_verdict_are_on_the_page(make_dashboard):
    import numpy as np

    rng = np.random.default_rng(9)

    def side(median_ms: float) -> WindowStats:
        samples = tuple(float(v) for v in rng.lognormal(np.log(median_ms), 0.3, 300))
        return WindowStats(requests=300, errors=0, p99_ms=max(samples), latency_samples_ms=samples)

    dashboard = make_dashboard(view_without_token=True)
    dashboard.target.layered, dashboard.target.spine = side(20.0), side(26.0)
    judged = PLAN.replace("stages:\n", "judge:\n  groups:\n"
                          "    - {name: latency, weight: 20, metrics: [{name: latency, kind: latency}]}\n"
                          "    - {name: errors, weight: 80, metrics: [{name: errors, kind: error_rate}]}\n"
                          "stages:\n")
    dashboard.controller.start(load_plan(judged), "test")
    for state in events(dashboard.url):
        if state["judge"]:
            break
    score, *metrics = state["judge"]
    assert (score["gate"], score["value"], score["threshold"], score["verdict"]) == ("judge", 80.0, 90.0, "inconclusive")
    assert score["message"].startswith("marginal: score 80.0")
    latency = next(m for m in metrics if m["gate"] == "judge.latency")
    assert latency["verdict"] == "fail" and latency["value"] > latency["threshold"] > 0  # shift beyond its margin
    assert "98% CI [" in latency["message"]
    assert state["status"]["stage_name"] == "first-stage"  # marginal: the stage holds
    code, page = dashboard.request("GET", "/")
    assert code == 200 and 'id="judge-section"' in page
