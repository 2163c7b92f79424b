"""The lease and its fence on one sqlite file shared by two controllers (as two replicas on
one machine would share it): a write commits only while its writer's epoch is current."""

from __future__ import annotations

import pytest

from migration.controller import Controller
from migration.leadership import LeaderElector, LeaseSettings, NotLeader
from migration.lease import Fenced
from migration.plan import load_plan
from migration.recording import RecordingTarget
from migration.state_store import Store
from migration.status import State
from services.common import ConfigError
from tests.waiting import eventually

LEASE_S = 0.3
PLAN = load_plan("""\
name: fenced
window_s: 5
stages:
  - {name: canary, spine_weight: 5, hold_s: 3600}
  - {name: half, spine_weight: 50, hold_s: 3600}
""")


def take_over(store: Store, holder: str, lease_s: float = LEASE_S) -> int:
    """Wait out the other holder's lease, then take it (for `lease_s`); the new epoch."""
    lease = eventually(lambda: (lease := store.try_acquire(holder, f"unix:/{holder}", lease_s, None))
                       .holder == holder and lease, timeout=10, what=f"{holder} takes the expired lease")
    store.fence_with(holder, lease.epoch)
    return lease.epoch


def lead(store: Store, holder: str) -> int:
    store.elected()
    lease = store.try_acquire(holder, f"unix:/{holder}", LEASE_S, None)
    assert lease.holder == holder
    store.fence_with(holder, lease.epoch)
    return lease.epoch


def test_a_free_lease_is_taken_at_epoch_one_and_a_live_one_is_left_to_its_holder(tmp_path):
    a, b = Store.open(tmp_path / "s.db"), Store.open(tmp_path / "s.db")
    assert lead(a, "a") == 1
    seen = b.try_acquire("b", "unix:/b", LEASE_S, None)
    assert (seen.holder, seen.epoch, seen.address) == ("a", 1, "unix:/a")
    renewed = a.try_acquire("a", "unix:/a", LEASE_S, 1)
    assert (renewed.holder, renewed.epoch) == ("a", 1) and renewed.renewed_at >= seen.renewed_at


def test_an_old_leader_cannot_write_once_another_took_the_lease(tmp_path):
    a, b = Store.open(tmp_path / "s.db"), Store.open(tmp_path / "s.db")
    a_ctl = Controller(a, RecordingTarget())
    lead(a, "a")
    a_ctl.start(PLAN, "erin")
    b.elected()
    assert take_over(b, "b", lease_s=60) == 2  # still b's when the refusal names who leads, however slow the host
    before = b.load()

    with pytest.raises(Fenced, match=r"epoch 1.*b at unix:/b \(epoch 2\) leads"):
        a.save(a_ctl.status, audit=("erin", "pause", "progressing", "canary", "stale"))
    assert a.fenced_writes == 1
    assert b.load() == before
    assert [row.action for row in b.audit()] == ["start"]


def test_an_old_leader_pushes_nothing_to_the_data_path_and_records_nothing(tmp_path):
    a, b = Store.open(tmp_path / "s.db"), Store.open(tmp_path / "s.db")
    target = RecordingTarget()
    a_ctl = Controller(a, target)
    lead(a, "a")
    a_ctl.start(PLAN, "erin")
    b.elected()
    take_over(b, "b")

    for attempt in (lambda: a_ctl.advance(None, "erin"), lambda: a_ctl.rollback("erin"),
                    lambda: a_ctl.abort("erin")):
        with pytest.raises(Fenced):
            attempt()
    assert a.fenced_writes == 3
    assert [applied.spine_weight for applied in target.applies] == [5.0]  # the start's, nothing after
    assert a_ctl.status.state is State.PROGRESSING  # its view did not move either
    assert [row.action for row in b.audit()] == ["start"]


def test_the_new_leader_resumes_the_same_stage_from_the_record(tmp_path):
    a, b = Store.open(tmp_path / "s.db"), Store.open(tmp_path / "s.db")
    lead(a, "a")
    a_ctl = Controller(a, RecordingTarget())
    a_ctl.start(PLAN, "erin")
    a_ctl.advance("half", "erin")
    b_target = RecordingTarget()
    b_ctl = Controller(b, b_target)
    b.elected()
    epoch = take_over(b, "b")

    b_ctl.take_lead(f"b took over as leader (lease epoch {epoch})")
    assert (b_ctl.status.state, b_ctl.status.stage_index) == (State.PROGRESSING, 1)
    assert [applied.spine_weight for applied in b_target.applies] == [50.0]
    rows = b.audit()
    assert [row.action for row in rows] == ["start", "advance", "recover"]
    assert "b took over as leader (lease epoch 2)" in rows[-1].reason and rows[-1].stage == "half"


def test_a_replica_that_never_held_the_lease_cannot_write(tmp_path):
    a, b = Store.open(tmp_path / "s.db"), Store.open(tmp_path / "s.db")
    lead(a, "a")
    b.elected()
    with pytest.raises(Fenced, match="does not hold the lease"):
        Controller(b, RecordingTarget()).start(PLAN, "erin")
    assert b.load() is None


def test_a_released_lease_is_taken_at_once(tmp_path):
    a, b = Store.open(tmp_path / "s.db"), Store.open(tmp_path / "s.db")
    lead(a, "a")
    a.release("a", 1)
    lease = b.try_acquire("b", "unix:/b", 60.0, None)
    assert (lease.holder, lease.epoch) == ("b", 2)


def test_lease_settings_must_let_the_leader_give_up_before_its_lease_expires():
    assert LeaseSettings() == LeaseSettings(15.0, 10.0, 2.0)
    with pytest.raises(ConfigError, match="--lease-renew-deadline-s"):
        LeaseSettings(duration_s=5, renew_deadline_s=10, retry_period_s=2)


def electors(tmp_path, names: tuple[str, ...]) -> list[LeaderElector]:
    settings = LeaseSettings(duration_s=0.6, renew_deadline_s=0.4, retry_period_s=0.05)
    return [LeaderElector(Store.open(tmp_path / "s.db"), name, f"unix:/{name}", settings).start() for name in names]


def test_one_elector_leads_and_the_others_name_it(tmp_path):
    running = electors(tmp_path, ("a", "b", "c"))
    try:
        leader = eventually(lambda: next((e for e in running if e.leading), None), what="a leader")
        others = [e for e in running if e is not leader]
        for other in others:
            eventually(lambda other=other: other.leader() is not None, what="the others see the lease")
            assert other.leader().holder == leader.identity and not other.leading
            with pytest.raises(NotLeader, match=f"send writes to the leader, {leader.identity} at unix:/"):
                other.check_write()
        leader.check_write()  # the leader may write
    finally:
        for elector in running:
            elector.stop()


def test_a_leader_that_stops_releases_the_lease_and_another_takes_the_next_epoch(tmp_path):
    running = electors(tmp_path, ("a", "b"))
    try:
        leader = eventually(lambda: next((e for e in running if e.leading), None), what="a leader")
        (other,) = [e for e in running if e is not leader]
        epoch = leader.epoch
        leader.stop()
        eventually(lambda: other.leading, what="the other takes over")
        assert other.epoch == epoch + 1
    finally:
        for elector in running:
            elector.stop()


def test_a_leader_whose_write_was_fenced_steps_down_and_waits_for_a_new_epoch(tmp_path):
    (elector,) = electors(tmp_path, ("a",))
    try:
        eventually(lambda: elector.leading, what="a leads")
        first = elector.epoch
        elector.step_down()
        assert not elector.leading and elector.epoch is None
        eventually(lambda: elector.leading, timeout=10, what="a leads again once its old lease expired")
        assert elector.epoch == first + 1  # never its old epoch back by name
    finally:
        elector.stop()
