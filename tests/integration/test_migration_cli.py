"""`spine migrate …` against a real controller server: tables, --json, exit codes."""

from __future__ import annotations

import json
import shutil
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from migration.recording import RecordingTarget
from migration.server import ControllerProcess
from migration.testing import ADMIN_TOKEN, HEALTHY, THREE_STAGES
from spine.cli.migrate import main

FAST_PLAN = textwrap.dedent("""\
    name: fast
    window_s: 0.1
    min_window_requests: 5
    stages:
      - {name: a, spine_weight: 10, placements: {logs: local}, hold_s: 0.2,
         gates: [{type: error_rate, max_delta: 0.01}]}
      - {name: b, spine_weight: 100, placements: {auth: local}, hold_s: 0.2}
    """)


@pytest.fixture
def cli(tmp_path, monkeypatch) -> Iterator[tuple[list[str], Path]]:
    sockets = tempfile.mkdtemp(prefix="mig", dir="/tmp")
    process = ControllerProcess(str(tmp_path / "m.db"), f"unix:{sockets}/c.sock", ADMIN_TOKEN,
                                RecordingTarget(layered=HEALTHY, spine=HEALTHY), tick_s=0.02)
    process.service._heartbeat_s = 0.1
    process.start()
    monkeypatch.setenv("SPINE_ADMIN_TOKEN", ADMIN_TOKEN)
    (tmp_path / "three.yaml").write_text(THREE_STAGES)
    (tmp_path / "fast.yaml").write_text(FAST_PLAN)
    try:
        yield ["migrate", "--controller", process.listen], tmp_path
    finally:
        process.stop(grace=0.2)
        shutil.rmtree(sockets, ignore_errors=True)


def run(base: list[str], *args: str) -> int:
    command, rest = args[0], list(args[1:])
    return main([base[0], command, "--controller", base[2], *rest])


def test_status_json_reports_state_stage_and_weights(cli, capsys):
    base, files = cli
    assert run(base, "run", str(files / "three.yaml"), "--no-follow", "--json") == 0
    capsys.readouterr()
    assert run(base, "status", "--json") == 0
    status = json.loads(capsys.readouterr().out)
    assert (status["state"], status["stage_name"], status["spine_weight"], status["layered_weight"]) == (
        "progressing", "logs", 10.0, 90.0)
    assert status["recent_audit"][0]["action"] == "start"


def test_status_table_shows_state_stage_weights_and_placements(cli, capsys):
    base, files = cli
    run(base, "run", str(files / "three.yaml"), "--no-follow")
    capsys.readouterr()
    assert run(base, "status") == 0
    out = capsys.readouterr().out
    for text in ("progressing", "1/3 logs", "spine 10%", "layered 90%", "placements", "recent audit"):
        assert text in out


def test_advance_pause_resume_rollback_abort_drive_the_controller(cli, capsys):
    base, files = cli
    run(base, "run", str(files / "three.yaml"), "--no-follow")
    capsys.readouterr()
    for command, state in (("pause", "paused"), ("pause", "paused"), ("resume", "progressing"),
                           ("rollback", "rolled_back"), ("abort", "aborted")):
        assert run(base, command, "--json", "--reason", "test") == 0
        assert json.loads(capsys.readouterr().out)["state"] == state


def test_advance_names_the_next_stage(cli, capsys):
    base, files = cli
    run(base, "run", str(files / "three.yaml"), "--no-follow")
    capsys.readouterr()
    assert run(base, "advance", "--json") == 0
    assert json.loads(capsys.readouterr().out)["stage_name"] == "cache"


def test_a_refused_command_exits_1_with_the_reason(cli, capsys):
    base, _ = cli
    assert run(base, "approve") == 1
    assert "nothing awaits approval" in capsys.readouterr().err


def test_a_wrong_token_exits_3(cli, capsys, monkeypatch):
    base, _ = cli
    monkeypatch.setenv("SPINE_ADMIN_TOKEN", "not-the-admin-token-at-all")
    assert run(base, "status") == 3
    err = capsys.readouterr().err
    assert "unauthenticated" in err and "not-the-admin-token" not in err


def test_an_invalid_plan_exits_2_naming_field_and_line(cli, capsys):
    base, files = cli
    (files / "bad.yaml").write_text(THREE_STAGES.replace("max_delta: 0.01}\n      - {type: latency",
                                                         "max_delta: 2}\n      - {type: latency"))
    assert run(base, "plan", str(files / "bad.yaml")) == 2
    assert "stages[0].gates[0].max_delta (line 10): must be between 0 and 1, got 2" in capsys.readouterr().err
    assert run(base, "plan", str(files / "bad.yaml"), "--offline") == 2


def test_a_parity_gate_without_shadow_traffic_exits_2_with_the_reason(tmp_path, capsys, monkeypatch):
    sockets = tempfile.mkdtemp(prefix="mig", dir="/tmp")
    target = RecordingTarget(layered=HEALTHY, spine=HEALTHY, shadow_enabled=False)
    process = ControllerProcess(str(tmp_path / "m.db"), f"unix:{sockets}/c.sock", ADMIN_TOKEN, target, tick_s=0.02)
    process.start()
    monkeypatch.setenv("SPINE_ADMIN_TOKEN", ADMIN_TOKEN)
    (tmp_path / "three.yaml").write_text(THREE_STAGES)
    base = ["migrate", "--controller", process.listen]
    try:
        for args in (("plan",), ("plan", "--validate-only"), ("run",)):
            assert run(base, args[0], str(tmp_path / "three.yaml"), *args[1:]) == 2, args
            err = capsys.readouterr().err
            assert "error (invalid_argument)" in err and "this recording target was told shadow is off" in err
            assert "stages[0].gates[2] (line 12): parity gate with no shadow comparisons to read" in err
        assert target.applies == []
    finally:
        process.stop(grace=0.2)
        shutil.rmtree(sockets, ignore_errors=True)


def test_plan_loads_and_run_follows_to_promotion(cli, capsys):
    base, files = cli
    assert run(base, "plan", str(files / "fast.yaml")) == 0
    assert "loaded as the pending plan" in capsys.readouterr().out
    assert run(base, "run", "--json") == 0
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    actions = [e["audit"]["action"] for e in events if "audit" in e]
    assert actions[0] == "start" and actions[-1] == "promote" and "advance" in actions
    assert events[-1]["status"]["state"] == "promoted"


def test_an_unreachable_controller_exits_4(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPINE_ADMIN_TOKEN", ADMIN_TOKEN)
    assert main(["migrate", "status", "--controller", f"unix:{tmp_path}/none.sock", "--timeout", "1"]) == 4
    assert "cannot reach the controller" in capsys.readouterr().err


def test_a_token_file_others_can_read_is_refused_naming_the_fix(tmp_path):
    from migration.admin_token import read_admin_token
    from services.common import ConfigError

    path = tmp_path / "token"
    path.write_text("a-long-enough-admin-token\n")
    path.chmod(0o644)
    with pytest.raises(ConfigError, match=r"readable by other users \(mode 0644\); chmod 600"):
        read_admin_token(str(path))
    path.chmod(0o600)
    assert read_admin_token(str(path)) == "a-long-enough-admin-token"
