"""The migration controller across a restart: the persisted stage is applied again, its hold
goes on, a paused rollout stays paused, the plan's route header survives."""

from __future__ import annotations

from migration.controller import Controller
from migration.plan import load_plan
from migration.recording import RecordingTarget
from migration.status import State
from migration.testing import HEALTHY, THREE_STAGES, make_controller, three_stages

OP = "alice@ops"


def test_reopening_reapplies_the_persisted_stage_and_continues_its_hold(tmp_path):
    db = str(tmp_path / "m.db")
    controller, _, clock = make_controller(db)
    controller.start(three_stages(), OP)
    controller.advance("cache", OP)
    controller.tick(clock.now)
    controller.tick(clock.advance(1))
    started = controller.status.stage_started_at
    controller.close()

    target = RecordingTarget(layered=HEALTHY, spine=HEALTHY)
    reopened = Controller.open(db, target, clock=clock)
    status = reopened.status
    assert status.state is State.PROGRESSING and status.stage_index == 1
    assert [a.spine_weight for a in target.applies] == [50]
    assert target.last.placements["cache"] == "local"
    assert status.stage_started_at == started and status.last_verdict == ""
    assert reopened.store.audit()[-1].action == "recover"
    # The hold (2 s) is already served; one fresh passing window after the ACK completes it.
    reopened.tick(clock.advance(0.1))
    assert reopened.status.state is State.PROGRESSING
    reopened.tick(clock.advance(1))
    assert reopened.status.state is State.AWAITING_APPROVAL


def test_every_apply_carries_the_plans_route_header_across_a_restart(tmp_path):
    """Stage, rollback, resume, abort and the re-apply after a restart all hand the data path
    the running plan's `route_header`; without the field it is on (the operator's tool)."""
    closed = load_plan("route_header: false\n" + THREE_STAGES)
    db = str(tmp_path / "m.db")
    controller, target, clock = make_controller(db)
    controller.start(closed, OP)
    controller.advance("cache", OP)
    controller.rollback(OP)
    controller.resume(OP, "fixed")
    controller.close()
    reopened, after_restart, _ = make_controller(db, clock=clock)
    reopened.abort(OP)
    assert [a.route_header for a in target.applies] == [False] * 4
    assert [(a.spine_weight, a.route_header) for a in after_restart.applies] == [(50, False), (0, False)]

    controller, target, _ = make_controller(str(tmp_path / "open.db"))
    controller.start(three_stages(), OP)
    controller.abort(OP)
    assert [a.route_header for a in target.applies] == [True, True]


def test_reopening_a_paused_rollout_stays_paused(tmp_path):
    db = str(tmp_path / "m.db")
    controller, _, clock = make_controller(db)
    controller.start(three_stages(), OP)
    controller.pause(OP)
    controller.close()
    reopened, target, _ = make_controller(db, clock=clock)
    assert reopened.status.state is State.PAUSED and target.last.spine_weight == 10
