"""A migration from a foreign gateway is shown as one: the CLI, the gates' messages and the
dashboard name the from-side by its plan's `legacy` endpoint and list no middlewares for a spine
that serves whole; the dashboard's link carries the admin token in its fragment."""

from __future__ import annotations

import json
import shutil
import tempfile
import textwrap
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from migration.legacy_endpoint import LegacyEndpoint
from migration.recording import RecordingTarget
from migration.server import ControllerProcess
from migration.testing import ADMIN_TOKEN
from spine.cli import main as spine_main
from tests.waiting import eventually

ROOT = Path(__file__).resolve().parents[2]
PLAN = textwrap.dedent("""\
    name: from-litellm
    legacy: {name: litellm, http: "http://127.0.0.1:4000"}
    window_s: 0.1
    min_window_requests: 5
    stages:
      - {name: canary, spine_weight: 20, hold_s: 60, gates: [{type: error_rate, max_delta: 0.02}]}
      - {name: all-spine, spine_weight: 100, hold_s: 1}
    """)


class ForeignTarget(RecordingTarget):
    """The data path of a migration from an HTTP endpoint (what `--target legacy-http` serves)."""

    def legacy(self) -> LegacyEndpoint:
        return LegacyEndpoint("http://127.0.0.1:4000")


@pytest.fixture
def controller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ControllerProcess]:
    sockets = tempfile.mkdtemp(prefix="from", dir="/tmp")
    process = ControllerProcess(str(tmp_path / "m.db"), f"unix:{sockets}/c.sock", ADMIN_TOKEN, ForeignTarget(),
                                tick_s=0.02, dashboard_listen="127.0.0.1:0")
    process.start()
    monkeypatch.setenv("SPINE_ADMIN_TOKEN", ADMIN_TOKEN)
    (tmp_path / "plan.yaml").write_text(PLAN)
    try:
        assert spine_main(["migrate", "run", str(tmp_path / "plan.yaml"), "--no-follow", "--json",
                           "--controller", process.listen]) == 0
        eventually(lambda: process.controller.view().last_gates, what="a judged window")
        yield process
    finally:
        process.stop(grace=0.2)
        shutil.rmtree(sockets, ignore_errors=True)


def test_status_names_the_foreign_gateway_and_lists_no_middlewares(controller: ControllerProcess,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert spine_main(["migrate", "status", "--controller", controller.listen]) == 0
    out = capsys.readouterr().out
    assert "spine 20%  litellm 80%" in out and "litellm (a foreign gateway" in out
    assert "vs litellm" in out  # the error-rate gate's message
    assert "layered" not in out and "remote" not in out and "placements" not in out
    [link] = [word for word in out.split() if "#token=" in word]
    assert link == f"{controller.dashboard_url}#token={urllib.parse.quote(ADMIN_TOKEN, safe='')}"


def test_the_dashboard_names_the_foreign_gateway(controller: ControllerProcess) -> None:
    assert controller.dashboard_url is not None
    request = urllib.request.Request(controller.dashboard_url + "api/state",
                                     headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        state = json.loads(answer.read())
    assert state["status"]["from_side"] == "litellm" and state["plan"]["from_side"] == "litellm"
    assert "vs litellm" in state["status"]["last_gates"][0]["message"]
    script = urllib.request.urlopen(controller.dashboard_url + "dashboard.js", timeout=10).read().decode()
    assert "location.hash" in script and "history.replaceState" in script  # the link's token, read and hidden


def test_a_plan_for_a_foreign_gateway_checked_offline_says_what_it_moves_from(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert spine_main(["migrate", "plan", "--offline", str(ROOT / "deploy/plans/legacy-litellm.yaml")]) == 0
    out = capsys.readouterr().out
    assert "from litellm to the spine" in out and "whole" in out
    assert spine_main(["migrate", "plan", "--offline", str(ROOT / "deploy/plans/demo.yaml")]) == 0
    assert "from layered to the spine" in capsys.readouterr().out
