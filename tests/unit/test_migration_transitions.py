"""Walk EVERY (state, action) pair of the transition table against a real controller.

tests/unit/test_migration_controller.py keeps an independent, hand-written matrix of what each
command should do; this file checks the other direction: that the controller does exactly
what `migration.transitions.TRANSITIONS` says, pair by pair, refused pairs included. Each
case builds its state through ordinary commands and ticks on a real sqlite file, with a
target that ACKs only when told (so one action is one transition, nothing settles behind
the test's back).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from migration.controller import SYSTEM_ACTOR, Controller, InvalidTransition
from migration.plan import load_plan
from migration.recording import RecordingTarget
from migration.status import FINISHED, State
from migration.testing import HEALTHY, FakeClock, make_controller, run_windows, three_stages
from migration.transitions import COMMANDS, TRANSITIONS, Action, Effect, accepted, table_text, transition

OP = "walker@ops"
APPLYING = {Effect.ENTER, Effect.ROLL_BACK, Effect.REAPPLY}  # effects that tell the data path
TICK_WORK = {Effect.WATCH, Effect.PROGRESS, Effect.SETTLE, Effect.NOTE_ACK}  # reconciling, no audit row of its own


class Target(RecordingTarget):
    """ACKs only what the test acks; `broken` makes every apply fail (a data path that is down)."""

    def __init__(self) -> None:
        super().__init__(layered=HEALTHY, spine=HEALTHY, auto_ack=False)
        self.broken = False

    def apply(self, spine_weight: float, placements: dict[str, str], version: str, *,
              route_header: bool) -> None:
        if self.broken:
            raise ConnectionError("data path unreachable")
        super().apply(spine_weight, placements, version, route_header=route_header)


class Rig:
    def __init__(self, tmp_path: Path) -> None:
        self.db = str(tmp_path / "walk.db")
        self.target = Target()
        self.clock = FakeClock()
        self.controller, _, _ = make_controller(self.db, target=self.target, clock=self.clock)

    def ack(self) -> None:
        self.target.ack(self.controller.status.version)


def _setup(variant: str, rig: Rig) -> None:
    """Bring the rollout into `variant` (a state, or paused_from_awaiting) the ordinary way."""
    c, plan = rig.controller, three_stages()
    steps: dict[str, Callable[[], object]] = {
        "pending": lambda: None,
        "progressing": lambda: (c.start(plan, OP), rig.ack()),
        "paused": lambda: (c.start(plan, OP), rig.ack(), c.tick(rig.clock.now), c.pause(OP)),
        "awaiting_approval": lambda: (c.start(plan, OP), c.advance("cache", OP), rig.ack(),
                                      run_windows(c, rig.clock, 2)),
        "paused_from_awaiting": lambda: (_setup("awaiting_approval", rig), c.pause(OP)),
        "promoted": lambda: (c.start(plan, OP), c.advance("all", OP), rig.ack(), c.advance(None, OP)),
        "rolling_back": lambda: (c.start(plan, OP), rig.ack(), c.rollback(OP)),
        "rolled_back": lambda: (c.start(plan, OP), c.rollback(OP), rig.ack(), c.tick(rig.clock.now)),
        "aborted": lambda: (c.start(plan, OP), c.abort(OP)),
    }
    steps[variant]()


def _approve(c: Controller) -> object:
    """Approve as a well-formed call would: the awaited stage, else the current one (a retry)."""
    view = c.view()
    name = view.awaiting_stage or (view.stage.name if view.stage else None)
    return c.approve(name, OP)


def _reopen(rig: Rig) -> object:
    """Recover the way it happens: the process restarts on the same sqlite file."""
    rig.controller.close()
    rig.controller = Controller.open(rig.db, rig.target, clock=rig.clock)
    return rig.controller


# How the walk performs each action. Operator commands and tick go through the public API;
# the controller's own transitions (promote, await_approval, rolled_back) are normally
# issued only by tick, so the walk calls the same internal entry point tick uses.
DRIVERS: dict[Action, Callable[[Rig], object]] = {
    Action.LOAD: lambda r: r.controller.load(three_stages(), OP),
    Action.START: lambda r: r.controller.start(three_stages(), OP),
    Action.ADVANCE: lambda r: r.controller.advance(None, OP),
    Action.PAUSE: lambda r: r.controller.pause(OP),
    Action.RESUME: lambda r: r.controller.resume(OP),
    Action.APPROVE: lambda r: _approve(r.controller),
    Action.ROLLBACK: lambda r: r.controller.rollback(OP),
    Action.ABORT: lambda r: r.controller.abort(OP),
    Action.TICK: lambda r: r.controller.tick(r.clock.now),
    Action.PROMOTE: lambda r: r.controller._perform(Action.PROMOTE, OP, "walk"),
    Action.AWAIT_APPROVAL: lambda r: r.controller._perform(Action.AWAIT_APPROVAL, OP, "walk"),
    Action.ROLLED_BACK: lambda r: r.controller._perform(Action.ROLLED_BACK, OP, "walk"),
    Action.RECOVER: _reopen,
}

VARIANTS = [str(state) for state in State] + ["paused_from_awaiting"]
CASES = [(variant, action) for variant in VARIANTS for action in Action]


def test_the_walk_drives_every_action_and_every_state() -> None:
    assert set(DRIVERS) == set(Action)
    assert {State(v) for v in VARIANTS if v in set(State)} == set(State)


@pytest.mark.parametrize("variant, action", CASES, ids=[f"{v}-{a}" for v, a in CASES])
def test_every_state_and_action_does_what_the_table_says(tmp_path: Path, variant: str, action: Action) -> None:
    rig = Rig(tmp_path)
    _setup(variant, rig)
    c = rig.controller
    state = c.status.state
    assert state == (State.PAUSED if variant == "paused_from_awaiting" else State(variant))
    before, persisted, rows = c.status, c.store.load(), c.store.audit()
    applies, gates = list(rig.target.applies), c.store.gate_history()
    step = TRANSITIONS.get((state, action))

    if step is None:
        with pytest.raises(InvalidTransition) as refused:
            DRIVERS[action](rig)
        message = str(refused.value)
        assert str(state) in message and str(action) in message
        assert all(str(command) in message for command in accepted(state))
        after = rig.controller
        assert after.status == before and after.store.load() == persisted
        assert after.store.audit() == rows and rig.target.applies == applies
        assert after.store.gate_history() == gates
        return

    DRIVERS[action](rig)
    after = rig.controller
    new_rows = after.store.audit()[len(rows):]
    if step.effect is Effect.NONE:
        assert after.status == before and after.store.load() == persisted
        assert new_rows == [] and rig.target.applies == applies
        return
    expected = step.next if step.next is not None else State(before.resume_state)
    assert after.status.state is expected and after.store.load() == after.status
    if step.effect in TICK_WORK:
        assert new_rows == []  # any transition tick decides on is its own table entry
        return
    [row] = new_rows
    actor = SYSTEM_ACTOR if action is Action.RECOVER else OP
    assert (row.action, row.from_state, row.to_state, row.actor) == (
        step.record_as or str(action), str(state), str(expected), actor)
    told = rig.target.applies[len(applies):]
    assert len(told) == (1 if step.effect in APPLYING else 0)
    if told:
        assert told[0].version == after.status.version and not after.status.acked
    if expected is not State.PAUSED:
        assert after.status.paused_at is None and after.status.resume_state == ""


APPLYING_COMMANDS = [(v, a) for v, a in CASES if a in COMMANDS
                     and (step := TRANSITIONS.get((State.PAUSED if v == "paused_from_awaiting" else State(v), a)))
                     and step.effect in APPLYING]


@pytest.mark.parametrize("variant, action", APPLYING_COMMANDS, ids=[f"{v}-{a}" for v, a in APPLYING_COMMANDS])
def test_a_transition_whose_apply_fails_changes_nothing(tmp_path: Path, variant: str, action: Action) -> None:
    """The data path is told FIRST: when it refuses, neither status nor audit moved."""
    rig = Rig(tmp_path)
    _setup(variant, rig)
    c = rig.controller
    before, persisted, rows, plan = c.status, c.store.load(), c.store.audit(), c.plan
    rig.target.broken = True
    with pytest.raises(ConnectionError):
        DRIVERS[action](rig)
    assert c.status == before and c.store.load() == persisted and c.store.audit() == rows
    assert c.plan is plan


def test_tick_and_recover_are_never_refused() -> None:
    for state in State:
        assert transition(state, Action.TICK).next is state
        assert transition(state, Action.RECOVER).next is state


def test_a_tick_while_paused_judges_nothing_even_when_the_gates_would_fail(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    _setup("paused", rig)
    rig.target.spine = HEALTHY.__class__(requests=100, errors=90, p99_ms=10.0)
    for _ in range(10):
        rig.controller.tick(rig.clock.advance(1))
    assert rig.controller.status.state is State.PAUSED
    assert rig.target.stats_calls == [] and rig.controller.store.gate_history() == []


def test_resume_returns_to_the_state_it_was_paused_from(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    _setup("paused_from_awaiting", rig)
    assert rig.controller.resume(OP).state is State.AWAITING_APPROVAL


def test_finished_agrees_with_the_table() -> None:
    """status.FINISHED (read by the demo) is exactly the states where start enters stage one."""
    starts = {s for s in State if (step := TRANSITIONS.get((s, Action.START))) and step.effect is Effect.ENTER}
    assert starts == FINISHED


def test_a_refusal_names_state_action_and_what_is_accepted(tmp_path: Path) -> None:
    controller, _, _ = make_controller(str(tmp_path / "m.db"))
    with pytest.raises(InvalidTransition) as refused:
        controller.pause(OP)
    assert str(refused.value) == ("cannot pause while the rollout is pending; pending accepts load, start; "
                                  "start a plan first")
    controller.start(three_stages(), OP)
    controller.abort(OP)
    with pytest.raises(InvalidTransition, match="nothing awaits approval: cannot approve while the rollout is "
                                                "aborted at stage 'logs' of plan 'three'; aborted accepts load, "
                                                r"start \(and, as no-op retries, rollback, abort\); start a plan"):
        controller.approve(None, OP)


def test_loading_over_a_running_rollout_says_to_abort_first(tmp_path: Path) -> None:
    controller, _, _ = make_controller(str(tmp_path / "m.db"))
    controller.start(three_stages(), OP)
    other = load_plan("name: other\nstages: [{name: x, spine_weight: 5, hold_s: 1}]\n")
    with pytest.raises(InvalidTransition, match=r"cannot load while the rollout is progressing .*; abort it"):
        controller.load(other, OP)


def test_the_table_prints_one_line_per_pair() -> None:
    text = table_text()
    assert len(text.splitlines()) == len(TRANSITIONS)
    assert "paused             resume          -> (paused-from state)" in text
