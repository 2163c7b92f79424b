"""The migration state machine: every transition, every refusal, idempotency, audit, restart."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from migration.controller import Controller, InvalidTransition
from migration.gates import WindowStats
from migration.plan import PlanError, load_plan
from migration.recording import RecordingTarget
from migration.status import State
from migration.testing import HEALTHY, THREE_STAGES, FakeClock, make_controller, run_windows, three_stages

OP = "alice@ops"
FAILING = WindowStats(requests=100, errors=50, p99_ms=10.0)


@pytest.fixture
def rig(tmp_path: Path) -> tuple[Controller, RecordingTarget, FakeClock]:
    return make_controller(str(tmp_path / "m.db"))


def audit_actions(controller: Controller) -> list[str]:
    return [row.action for row in controller.store.audit()]


# --- starting and advancing ---------------------------------------------------------------

def test_start_applies_the_first_stage_and_records_who_started_it(rig):
    controller, target, _ = rig
    status = controller.start(three_stages(), OP, "change 123")
    assert status.state is State.PROGRESSING and status.stage_index == 0
    assert target.last.spine_weight == 10
    assert target.last.placements == {"auth": "remote", "ratelimit": "remote", "router": "remote",
                                      "cache": "remote", "metrics": "local", "logs": "local"}
    [row] = controller.store.audit()
    assert (row.actor, row.action, row.from_state, row.to_state, row.stage, row.reason) == (
        OP, "start", "pending", "progressing", "logs", "change 123")


def test_gates_wait_until_the_data_planes_ack_the_version(tmp_path):
    target = RecordingTarget(layered=HEALTHY, spine=HEALTHY, auto_ack=False)
    controller, _, clock = make_controller(str(tmp_path / "m.db"), target=target)
    controller.start(three_stages(), OP)
    run_windows(controller, clock, 5)
    assert target.stats_calls == [] and controller.status.stage_index == 0
    target.ack(controller.status.version)
    run_windows(controller, clock, 2)
    assert controller.status.stage_index == 1


def test_stage_advances_after_hold_with_passing_gates_and_inherits_placements(rig):
    controller, target, clock = rig
    controller.start(three_stages(), OP)
    run_windows(controller, clock, 1)
    assert controller.status.stage_index == 0  # held 1 s of 2
    controller.tick(clock.advance(1))
    status = controller.status
    assert status.stage_index == 1 and status.state is State.PROGRESSING
    assert target.last.spine_weight == 50
    assert target.last.placements["cache"] == "local" and target.last.placements["logs"] == "local"
    assert target.last.placements["auth"] == "remote"
    advance = controller.store.audit()[-1]
    assert (advance.actor, advance.action, advance.stage) == ("controller", "advance", "cache")


def test_inconclusive_windows_hold_the_stage(rig):
    controller, target, clock = rig
    target.spine = WindowStats(requests=2, errors=0, p99_ms=10.0)
    controller.start(three_stages(), OP)
    run_windows(controller, clock, 10)
    status = controller.status
    assert status.stage_index == 0 and status.last_verdict == "inconclusive"
    assert status.consecutive_failures == 0
    history = controller.store.gate_history()
    assert {r.verdict for r in history} == {"inconclusive"} and len(history) == 30


def test_stage_waits_for_min_requests(tmp_path):
    plan = load_plan(textwrap.dedent("""\
        name: counted
        window_s: 1
        min_window_requests: 5
        stages:
          - {name: a, spine_weight: 10, min_requests: 250, gates: [{type: error_rate, max_delta: 0.01}]}
          - {name: b, spine_weight: 20, hold_s: 5}
        """))
    controller, _, clock = make_controller(str(tmp_path / "m.db"))
    controller.start(plan, OP)
    run_windows(controller, clock, 2)
    assert controller.status.stage_index == 0 and controller.status.stage_requests == 200
    controller.tick(clock.advance(1))
    assert controller.status.stage_index == 1


def test_a_failing_gate_rolls_back_to_layered_with_all_remote_placements_at_stage_zero(rig):
    controller, target, clock = rig
    controller.start(three_stages(), OP)
    target.spine = FAILING
    run_windows(controller, clock, 1)
    status = controller.status
    assert status.state is State.ROLLED_BACK
    assert target.last.spine_weight == 0 and set(target.last.placements.values()) == {"remote"}
    rollback = [row for row in controller.store.audit() if row.action == "rollback"][0]
    assert rollback.actor == "controller" and "error_rate" in rollback.reason
    assert "failure_limit 1" in rollback.reason


def test_failure_limit_counts_consecutive_failing_windows_only(rig):
    controller, target, clock = rig
    controller.start(three_stages(), OP)
    controller.advance("cache", OP)  # failure_limit 2
    controller.tick(clock.now)
    target.spine = FAILING
    controller.tick(clock.advance(1))
    assert controller.status.consecutive_failures == 1 and controller.status.state is State.PROGRESSING
    target.spine = HEALTHY
    controller.tick(clock.advance(1))
    assert controller.status.consecutive_failures == 0
    target.spine = FAILING
    controller.tick(clock.advance(1))
    controller.tick(clock.advance(1))
    assert controller.status.state is State.ROLLED_BACK
    # Rolled back from stage 1: placements return to stage 0's, all traffic to layered.
    assert target.last.spine_weight == 0
    assert target.last.placements["logs"] == "local" and target.last.placements["cache"] == "remote"


def test_a_failing_dry_run_gate_is_recorded_but_does_not_count(tmp_path):
    plan = load_plan(textwrap.dedent("""\
        name: dry
        window_s: 1
        min_window_requests: 5
        stages:
          - name: a
            spine_weight: 10
            hold_s: 1
            gates: [{type: latency_p99_ratio, max_ratio: 1.1, dry_run: true}]
          - {name: b, spine_weight: 20, hold_s: 5}
        """))
    target = RecordingTarget(layered=HEALTHY, spine=WindowStats(100, 0, 99.0))
    controller, _, clock = make_controller(str(tmp_path / "m.db"), target=target)
    controller.start(plan, OP)
    run_windows(controller, clock, 1)
    assert controller.status.stage_index == 1
    [record] = controller.store.gate_history()
    assert record.verdict == "fail" and record.dry_run


def test_a_stage_with_manual_approval_waits_before_it_is_entered(rig):
    controller, target, clock = rig
    controller.start(three_stages(), OP)
    controller.advance("cache", OP)
    run_windows(controller, clock, 2)
    status = controller.status
    assert status.state is State.AWAITING_APPROVAL and status.stage_index == 1
    assert target.last.spine_weight == 50
    run_windows(controller, clock, 3)
    assert controller.status.state is State.AWAITING_APPROVAL
    controller.approve(None, OP, "looks good")
    assert target.last.spine_weight == 100 and controller.status.stage_index == 2
    run_windows(controller, clock, 2)
    assert controller.status.state is State.PROMOTED
    assert audit_actions(controller)[-3:] == ["await_approval", "approve", "promote"]


def test_gates_keep_watching_while_awaiting_approval(rig):
    controller, target, clock = rig
    controller.start(three_stages(), OP)
    controller.advance("cache", OP)
    run_windows(controller, clock, 2)
    assert controller.status.state is State.AWAITING_APPROVAL
    target.spine = FAILING
    controller.tick(clock.advance(1))
    controller.tick(clock.advance(1))
    assert controller.status.state is State.ROLLED_BACK


# --- operator commands --------------------------------------------------------------------

def test_advance_to_a_named_stage_skips_ahead_and_to_the_current_one_is_a_no_op(rig):
    controller, target, _ = rig
    controller.start(three_stages(), OP)
    controller.advance("all", OP, "skip")
    assert controller.status.stage_index == 2 and target.last.spine_weight == 100
    rows = len(controller.store.audit())
    controller.advance("all", OP)
    assert len(controller.store.audit()) == rows


def test_advance_past_the_last_stage_promotes(rig):
    controller, _, _ = rig
    controller.start(three_stages(), OP)
    controller.advance("all", OP)
    assert controller.advance(None, OP).state is State.PROMOTED


def test_once_finished_a_tick_only_notes_the_ack_of_what_was_published_last(tmp_path):
    """An abort after promotion publishes 100% layered; the status says "applied" once the
    data path ACKed it, without a window judged or an audit row written."""
    target = RecordingTarget(layered=HEALTHY, spine=HEALTHY, auto_ack=False)
    controller, _, clock = make_controller(str(tmp_path / "m.db"), target=target)
    controller.start(three_stages(), OP)
    controller.advance("all", OP)
    controller.advance(None, OP)
    aborted = controller.abort(OP, "new spine build")
    assert aborted.state is State.ABORTED and aborted.spine_weight == 0 and not aborted.acked
    rows = len(controller.store.audit())
    run_windows(controller, clock, 2)
    assert not controller.status.acked
    target.ack(aborted.version)
    run_windows(controller, clock, 2)
    assert controller.status.acked and controller.status.state is State.ABORTED
    assert len(controller.store.audit()) == rows and target.stats_calls == [] and controller.store.gate_history() == []


@pytest.mark.parametrize("stage, message", [("nope", "unknown stage 'nope'"),
                                            ("logs", "use rollback to go back")])
def test_advance_to_an_unknown_or_earlier_stage_is_refused(rig, stage, message):
    controller, _, _ = rig
    controller.start(three_stages(), OP)
    controller.advance("cache", OP)
    with pytest.raises(InvalidTransition, match=message):
        controller.advance(stage, OP)
    assert controller.status.stage_index == 1


def test_pause_stops_evaluation_and_the_hold_does_not_count_paused_time(rig):
    controller, target, clock = rig
    controller.start(three_stages(), OP)
    controller.tick(clock.now)  # ACK: the 2 s hold starts
    controller.pause(OP, "investigating")
    run_windows(controller, clock, 10)
    assert target.stats_calls == [] and controller.status.state is State.PAUSED
    controller.resume(OP)
    controller.tick(clock.advance(1))
    assert controller.status.stage_index == 0  # 1 s held: the 10 paused seconds do not count
    controller.tick(clock.advance(1))
    assert controller.status.stage_index == 1


def test_approve_retried_with_the_stage_name_is_a_no_op(rig):
    controller, _, clock = rig
    controller.start(three_stages(), OP)
    controller.advance("cache", OP)
    run_windows(controller, clock, 2)
    controller.approve("all", OP)
    rows = len(controller.store.audit())
    controller.approve("all", OP)
    assert len(controller.store.audit()) == rows


def test_approve_names_the_stage_that_awaits_when_another_is_given(rig):
    controller, _, clock = rig
    controller.start(three_stages(), OP)
    controller.advance("cache", OP)
    run_windows(controller, clock, 2)
    with pytest.raises(InvalidTransition, match="'all' is"):
        controller.approve("cache", OP)


def test_rollback_with_a_slow_ack_stays_rolling_back_until_acked(tmp_path):
    target = RecordingTarget(layered=HEALTHY, spine=HEALTHY, auto_ack=False)
    controller, _, clock = make_controller(str(tmp_path / "m.db"), target=target)
    controller.start(three_stages(), OP)
    status = controller.rollback(OP, "pager")
    assert status.state is State.ROLLING_BACK and target.last.spine_weight == 0
    controller.tick(clock.advance(1))
    assert controller.status.state is State.ROLLING_BACK
    target.ack(status.version)
    assert controller.tick(clock.advance(0.1)).state is State.ROLLED_BACK


def test_resume_after_a_rollback_retries_the_stage_that_rolled_back(rig):
    controller, target, clock = rig
    controller.start(three_stages(), OP)
    controller.advance("cache", OP)
    controller.rollback(OP)
    status = controller.resume(OP, "fixed")
    assert status.state is State.PROGRESSING and status.stage_index == 1
    assert target.last.spine_weight == 50 and status.consecutive_failures == 0


def test_a_failed_apply_changes_nothing(tmp_path):
    class Broken(RecordingTarget):
        def apply(self, spine_weight: float, placements: dict[str, str], version: str, *,
                  route_header: bool) -> None:
            raise ConnectionError("front unreachable")

    controller, _, _ = make_controller(str(tmp_path / "m.db"), target=Broken())
    with pytest.raises(ConnectionError):
        controller.start(three_stages(), OP)
    assert controller.status.state is State.PENDING and controller.store.audit() == []
    assert controller.plan is None


def test_start_without_a_plan_is_refused(rig):
    controller, _, _ = rig
    with pytest.raises(InvalidTransition, match="no plan to start"):
        controller.start(None, OP)


def test_a_loaded_plan_is_started_by_start_without_a_plan(rig):
    controller, target, _ = rig
    controller.load(three_stages(), OP)
    assert controller.status.state is State.PENDING and target.applies == []
    assert controller.start(None, OP).state is State.PROGRESSING


def test_a_plan_with_a_parity_gate_is_refused_where_nothing_mirrors_traffic(tmp_path):
    controller, target, _ = make_controller(str(tmp_path / "m.db"),
                                            target=RecordingTarget(layered=HEALTHY, spine=HEALTHY,
                                                                   shadow_enabled=False))
    for command in (lambda: controller.load(three_stages(), OP), lambda: controller.start(three_stages(), OP)):
        with pytest.raises(PlanError) as refused:
            command()
        assert "none is configured for this data path: this recording target was told shadow is off" in str(refused.value)
        assert "stages[0].gates[2] (line 12): parity gate with no shadow comparisons to read" in refused.value.problems
    assert controller.status.state is State.PENDING and target.applies == [] and controller.store.audit() == []
    # The same plan without its parity gate is fine: only a gate that could never fail is refused.
    without = load_plan("".join(line for line in THREE_STAGES.splitlines(keepends=True) if "parity" not in line))
    assert controller.start(without, OP).state is State.PROGRESSING


def test_starting_a_different_plan_while_one_runs_is_refused(rig):
    controller, _, _ = rig
    controller.start(three_stages(), OP)
    other = load_plan("name: other\nstages: [{name: x, spine_weight: 5, hold_s: 1}]\n")
    with pytest.raises(InvalidTransition, match="abort it"):
        controller.start(other, OP)


# --- the full matrix: every command in every state ----------------------------------------

def _in_state(state: str, tmp_path: Path) -> tuple[Controller, RecordingTarget, FakeClock]:
    target = RecordingTarget(layered=HEALTHY, spine=HEALTHY, auto_ack=state != "rolling_back")
    controller, target, clock = make_controller(str(tmp_path / "m.db"), target=target)
    plan = three_stages()
    setups: dict[str, Callable[[], object]] = {
        "pending": lambda: None,
        "progressing": lambda: controller.start(plan, OP),
        "paused": lambda: (controller.start(plan, OP), controller.pause(OP)),
        "awaiting_approval": lambda: (controller.start(plan, OP), controller.advance("cache", OP),
                                      run_windows(controller, clock, 2)),
        "promoted": lambda: (controller.start(plan, OP), controller.advance("all", OP),
                             controller.advance(None, OP)),
        "rolling_back": lambda: (controller.start(plan, OP), controller.rollback(OP)),
        "rolled_back": lambda: (controller.start(plan, OP), controller.rollback(OP)),
        "aborted": lambda: (controller.start(plan, OP), controller.abort(OP)),
    }
    setups[state]()
    assert controller.status.state == state
    return controller, target, clock


COMMANDS: dict[str, Callable[[Controller], object]] = {
    "start": lambda c: c.start(three_stages(), OP),
    "advance": lambda c: c.advance(None, OP),
    "pause": lambda c: c.pause(OP),
    "resume": lambda c: c.resume(OP),
    "approve": lambda c: c.approve(None, OP),
    "rollback": lambda c: c.rollback(OP),
    "abort": lambda c: c.abort(OP),
}
# state -> command -> resulting state, "noop" (succeeds, records nothing) or "invalid".
MATRIX: dict[str, dict[str, str]] = {
    "pending": dict(start="progressing", advance="invalid", pause="invalid", resume="invalid",
                    approve="invalid", rollback="invalid", abort="invalid"),
    "progressing": dict(start="noop", advance="progressing", pause="paused", resume="noop",
                        approve="invalid", rollback="rolled_back", abort="aborted"),
    "paused": dict(start="noop", advance="progressing", pause="noop", resume="progressing",
                   approve="invalid", rollback="rolled_back", abort="aborted"),
    "awaiting_approval": dict(start="noop", advance="progressing", pause="paused", resume="noop",
                              approve="progressing", rollback="rolled_back", abort="aborted"),
    "promoted": dict(start="progressing", advance="invalid", pause="invalid", resume="invalid",
                     approve="invalid", rollback="rolled_back", abort="aborted"),
    "rolling_back": dict(start="invalid", advance="invalid", pause="invalid", resume="invalid",
                         approve="invalid", rollback="noop", abort="aborted"),
    "rolled_back": dict(start="progressing", advance="invalid", pause="invalid", resume="progressing",
                        approve="invalid", rollback="noop", abort="aborted"),
    "aborted": dict(start="progressing", advance="invalid", pause="invalid", resume="invalid",
                    approve="invalid", rollback="noop", abort="noop"),
}
CASES = [(state, command, outcome) for state, row in MATRIX.items() for command, outcome in row.items()]


@pytest.mark.parametrize("state, command, outcome", CASES, ids=[f"{s}-{c}" for s, c, _ in CASES])
def test_every_command_in_every_state(tmp_path, state, command, outcome):
    controller, target, _ = _in_state(state, tmp_path)
    before, rows, applies = controller.status, controller.store.audit(), list(target.applies)
    if outcome == "invalid":
        with pytest.raises(InvalidTransition):
            COMMANDS[command](controller)
        assert controller.status == before and controller.store.audit() == rows
        assert target.applies == applies
    elif outcome == "noop":
        COMMANDS[command](controller)
        assert controller.status == before and controller.store.audit() == rows
    else:
        COMMANDS[command](controller)
        assert controller.status.state == outcome
        new = controller.store.audit()[len(rows):]
        assert new and new[0].from_state == state and new[-1].to_state == outcome
        assert new[0].actor == OP


@pytest.mark.parametrize("command", ["pause", "rollback", "abort"])
def test_repeating_a_command_records_nothing_new(rig, command):
    controller, _, _ = rig
    controller.start(three_stages(), OP)
    COMMANDS[command](controller)
    rows, status = controller.store.audit(), controller.status
    COMMANDS[command](controller)
    assert controller.store.audit() == rows and controller.status == status
