"""The controller's store on a real PostgreSQL: the same contract as on sqlite (a transition's
status and audit row commit together or not at all), the lease's fence, and a server that
restarts under it."""

from __future__ import annotations

import psycopg
import pytest

from migration.gates import GateResult, Verdict
from migration.lease import Fenced
from migration.state_store import Store
from migration.status import RolloutStatus, State
from migration.store_backends import StoreUnavailable
from tests.postgres_server import fresh_database, postgres  # noqa: F401 - the fixture
from tests.waiting import eventually


@pytest.fixture
def dsn(postgres) -> str:  # noqa: F811 - the imported fixture
    return fresh_database(postgres, "store")


def test_a_transition_writes_the_status_and_its_audit_row_together(dsn):
    store = Store.open(dsn)
    status = RolloutStatus(plan_name="p", state=State.PROGRESSING, spine_weight=5.0,
                           placements={"cache": "local"}, updated_at=10.0)
    audit_id = store.save(status, audit=("bob", "start", "pending", "first", "why not"))
    store.close()
    reopened = Store.open(dsn)
    assert reopened.load() == status
    [row] = reopened.audit()
    assert row.id == audit_id
    assert (row.ts, row.actor, row.action, row.from_state, row.to_state, row.stage, row.reason) == (
        10.0, "bob", "start", "pending", "progressing", "first", "why not")
    assert reopened.transition_counts() == {"progressing": 1}


def test_a_failed_audit_insert_leaves_the_status_row_unchanged(dsn):
    store = Store.open(dsn)
    first = RolloutStatus(plan_name="p", state=State.PROGRESSING, updated_at=1.0)
    store.save(first, audit=("a", "start", "pending", "s", ""))
    with psycopg.connect(dsn, autocommit=True) as raw:
        raw.execute("CREATE FUNCTION refuse() RETURNS trigger AS $$ BEGIN RAISE EXCEPTION 'disk says no'; END $$"
                    " LANGUAGE plpgsql")
        raw.execute("CREATE TRIGGER refuse BEFORE INSERT ON audit FOR EACH ROW EXECUTE FUNCTION refuse()")
    with pytest.raises(psycopg.errors.RaiseException, match="disk says no"):
        store.save(RolloutStatus(plan_name="p", state=State.PAUSED, updated_at=2.0),
                   audit=("a", "pause", "progressing", "s", ""))
    assert store.load() == first and len(store.audit()) == 1


def test_gate_results_keep_their_order_and_none_values(dsn):
    store = Store.open(dsn)
    results = [GateResult("error_rate", Verdict.PASS, 0.001, 0.01, False, "ok"),
               GateResult("parity", Verdict.INCONCLUSIVE, None, 0, True, "few")]
    store.save(RolloutStatus(plan_name="p", state=State.PROGRESSING, version="p#1"),
               gates=[(r, "first", 5.0, 6.0) for r in results])
    assert [(r.gate, r.verdict, r.value, r.dry_run) for r in store.gate_history()] == [
        ("error_rate", "pass", 0.001, False), ("parity", "inconclusive", None, True)]


def test_an_old_leader_cannot_write_once_another_took_the_lease(dsn):
    a, b = Store.open(dsn), Store.open(dsn)
    for store in (a, b):
        store.elected()
    lease = a.try_acquire("a", "unix:/a", 0.3, None)
    a.fence_with("a", lease.epoch)
    a.save(RolloutStatus(plan_name="p", state=State.PROGRESSING, updated_at=1.0), audit=("a", "start", "pending", "s", ""))
    taken = eventually(lambda: (got := b.try_acquire("b", "unix:/b", 30.0, None)).holder == "b" and got,
                       timeout=10, what="b takes the expired lease")
    assert taken.epoch == lease.epoch + 1
    b.fence_with("b", taken.epoch)

    with pytest.raises(Fenced, match=r"b at unix:/b \(epoch 2\) leads"):
        a.save(RolloutStatus(plan_name="p", state=State.PAUSED, updated_at=2.0), audit=("a", "pause", "x", "s", ""))
    with pytest.raises(Fenced):
        a.check_fence()
    assert a.fenced_writes == 2
    assert b.load().state is State.PROGRESSING and len(b.audit()) == 1
    b.save(RolloutStatus(plan_name="p", state=State.PAUSED, updated_at=3.0), audit=("b", "pause", "x", "s", ""))
    assert len(a.audit()) == 2  # a reads what b wrote (a follower's view)


def test_a_restarted_server_costs_one_failed_call_and_nothing_committed(postgres, dsn):  # noqa: F811
    store = Store.open(dsn)
    saved = RolloutStatus(plan_name="p", state=State.PROGRESSING, updated_at=1.0)
    store.save(saved, audit=("a", "start", "pending", "s", ""))
    postgres.restart()
    with pytest.raises(StoreUnavailable) as failed:
        store.load()  # the connection the restart cut
    assert postgres.password not in str(failed.value)
    assert store.load() == saved  # reconnected, nothing lost
    assert len(store.audit()) == 1
