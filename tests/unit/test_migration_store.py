"""The sqlite store: durable settings, atomic transitions, history that survives reopening."""

from __future__ import annotations

import sqlite3

import pytest

from migration.gates import GateResult, Verdict
from migration.state_store import Store
from migration.status import RolloutStatus, State


def test_the_store_uses_wal_and_full_sync(tmp_path):
    store = Store.open(tmp_path / "m.db")
    assert store.pragma("journal_mode") == "wal"
    assert store.pragma("synchronous") == 2  # FULL


def test_a_transition_writes_the_status_and_its_audit_row_together(tmp_path):
    store = Store.open(tmp_path / "m.db")
    status = RolloutStatus(plan_name="p", state=State.PROGRESSING, spine_weight=5.0, updated_at=10.0)
    audit_id = store.save(status, audit=("bob", "start", "pending", "first", "why not"))
    store.close()
    reopened = Store.open(tmp_path / "m.db")
    assert reopened.load() == status
    [row] = reopened.audit()
    assert row.id == audit_id
    assert (row.ts, row.actor, row.action, row.from_state, row.to_state, row.stage, row.reason) == (
        10.0, "bob", "start", "pending", "progressing", "first", "why not")


def test_a_failed_audit_insert_leaves_the_status_row_unchanged(tmp_path):
    store = Store.open(tmp_path / "m.db")
    first = RolloutStatus(plan_name="p", state=State.PROGRESSING, updated_at=1.0)
    store.save(first, audit=("a", "start", "pending", "s", ""))
    raw = sqlite3.connect(tmp_path / "m.db")
    raw.execute("CREATE TRIGGER refuse BEFORE INSERT ON audit BEGIN SELECT RAISE(ABORT, 'disk says no'); END")
    raw.commit()
    raw.close()
    with pytest.raises(sqlite3.DatabaseError, match="disk says no"):
        store.save(RolloutStatus(plan_name="p", state=State.PAUSED, updated_at=2.0),
                   audit=("a", "pause", "progressing", "s", ""))
    assert store.load() == first and len(store.audit()) == 1


def test_gate_results_are_kept_in_order_with_the_window(tmp_path):
    store = Store.open(tmp_path / "m.db")
    status = RolloutStatus(plan_name="p", state=State.PROGRESSING, version="p#1")
    results = [GateResult("error_rate", Verdict.PASS, 0.001, 0.01, False, "ok"),
               GateResult("parity", Verdict.INCONCLUSIVE, None, 0, True, "few")]
    store.save(status, gates=[(r, "first", 5.0, 6.0) for r in results])
    history = store.gate_history()
    assert [(r.gate, r.verdict, r.value, r.dry_run, r.window_start, r.window_end, r.version) for r in history] == [
        ("error_rate", "pass", 0.001, False, 5.0, 6.0, "p#1"), ("parity", "inconclusive", None, True, 5.0, 6.0, "p#1")]
    assert store.audit() == []


def test_recent_audit_returns_the_newest_rows_oldest_first(tmp_path):
    store = Store.open(tmp_path / "m.db")
    for index in range(5):
        store.save(RolloutStatus(updated_at=float(index)), audit=("a", f"act{index}", "x", "", ""))
    assert [row.action for row in store.recent_audit(2)] == ["act3", "act4"]
    assert [row.action for row in store.audit(after_id=3)] == ["act3", "act4"]
