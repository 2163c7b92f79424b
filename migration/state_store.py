"""Durable rollout state in sqlite: one status row, the gate history and the audit trail.

WAL with `synchronous=FULL` means a committed transition survives a power cut, and every
transition is ONE transaction that writes the status row and its audit row together: after
a crash the status never disagrees with the audit trail that explains it.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from collections.abc import Iterable
from dataclasses import astuple, fields

from migration.gates import GateResult
from migration.status import AuditEntry, GateRecord, RolloutStatus, State

_SCHEMA = """
CREATE TABLE IF NOT EXISTS rollout (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    plan_name TEXT NOT NULL,
    plan_yaml TEXT NOT NULL,
    state TEXT NOT NULL,
    stage_index INTEGER NOT NULL,
    spine_weight REAL NOT NULL,
    placements TEXT NOT NULL,
    consecutive_failures INTEGER NOT NULL,
    generation INTEGER NOT NULL,
    version TEXT NOT NULL,
    acked INTEGER NOT NULL,
    stage_started_at REAL,
    window_started_at REAL,
    stage_requests INTEGER NOT NULL,
    last_verdict TEXT NOT NULL,
    paused_at REAL,
    resume_state TEXT NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS gate_results (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    ts REAL NOT NULL,
    stage TEXT NOT NULL,
    version TEXT NOT NULL,
    window_start REAL NOT NULL,
    window_end REAL NOT NULL,
    gate TEXT NOT NULL,
    verdict TEXT NOT NULL,
    value REAL,
    threshold REAL NOT NULL,
    dry_run INTEGER NOT NULL,
    message TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS audit (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    ts REAL NOT NULL,
    actor TEXT NOT NULL,
    action TEXT NOT NULL,
    from_state TEXT NOT NULL,
    to_state TEXT NOT NULL,
    stage TEXT NOT NULL,
    reason TEXT NOT NULL
);
"""

_STATUS_COLUMNS = [f.name for f in fields(RolloutStatus)]


class Store:
    """The controller's sqlite file. Thread-safe; one writer (the controller) at a time."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        self._lock = threading.RLock()

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Store:
        conn = sqlite3.connect(os.fspath(path), check_same_thread=False, timeout=5.0)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.executescript(_SCHEMA)
        return cls(conn)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def pragma(self, name: str) -> object:
        """A PRAGMA's current value (for checks that durability settings took)."""
        with self._lock:
            return self._conn.execute(f"PRAGMA {name}").fetchone()[0]

    def load(self) -> RolloutStatus | None:
        with self._lock:
            row = self._conn.execute(f"SELECT {', '.join(_STATUS_COLUMNS)} FROM rollout WHERE id = 1").fetchone()
        if row is None:
            return None
        values = dict(zip(_STATUS_COLUMNS, row, strict=True))
        values["state"] = State(values["state"])
        values["placements"] = json.loads(values["placements"])
        values["acked"] = bool(values["acked"])
        return RolloutStatus(**values)

    def save(self, status: RolloutStatus, *, audit: tuple[str, str, str, str, str] | None = None,
             gates: Iterable[tuple[GateResult, str, float, float]] = ()) -> int | None:
        """Write the status row, plus (in the same transaction) an audit row and gate results.

        `audit` is (actor, action, from_state, stage, reason); its to_state is the status's
        state. `gates` are (result, stage name, window start, window end). Returns the audit
        row id when one was written.
        """
        values = list(astuple(status))
        values[_STATUS_COLUMNS.index("placements")] = json.dumps(status.placements, sort_keys=True)
        values[_STATUS_COLUMNS.index("state")] = str(status.state)
        values[_STATUS_COLUMNS.index("acked")] = int(status.acked)
        placeholders = ", ".join("?" for _ in _STATUS_COLUMNS)
        audit_id = None
        with self._lock, self._conn:
            self._conn.execute(
                f"INSERT OR REPLACE INTO rollout (id, {', '.join(_STATUS_COLUMNS)}) VALUES (1, {placeholders})",
                values,
            )
            for result, stage, start, end in gates:
                self._conn.execute(
                    "INSERT INTO gate_results (ts, stage, version, window_start, window_end, gate, verdict,"
                    " value, threshold, dry_run, message) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (end, stage, status.version, start, end, result.gate, str(result.verdict), result.value,
                     result.threshold, int(result.dry_run), result.message),
                )
            if audit is not None:
                actor, action, from_state, stage, reason = audit
                cursor = self._conn.execute(
                    "INSERT INTO audit (ts, actor, action, from_state, to_state, stage, reason)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (status.updated_at, actor, action, from_state, str(status.state), stage, reason),
                )
                audit_id = cursor.lastrowid
        return audit_id

    def audit(self, after_id: int = 0, limit: int = 1000) -> list[AuditEntry]:
        """Audit rows with id > after_id, oldest first."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT id, ts, actor, action, from_state, to_state, stage, reason FROM audit"
                " WHERE id > ? ORDER BY id LIMIT ?", (after_id, limit)).fetchall()
        return [AuditEntry(*row) for row in rows]

    def recent_audit(self, limit: int) -> list[AuditEntry]:
        """The newest `limit` audit rows, oldest first."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT id, ts, actor, action, from_state, to_state, stage, reason FROM audit"
                " ORDER BY id DESC LIMIT ?", (limit,)).fetchall()
        return [AuditEntry(*row) for row in reversed(rows)]

    def audit_of(self, actions: Iterable[str], limit: int) -> list[AuditEntry]:
        """The newest `limit` audit rows of these actions, oldest first (the dashboard's runs)."""
        wanted = sorted(set(actions))
        with self._lock:
            rows = self._conn.execute(
                "SELECT id, ts, actor, action, from_state, to_state, stage, reason FROM audit"
                f" WHERE action IN ({', '.join('?' for _ in wanted)}) ORDER BY id DESC LIMIT ?",
                (*wanted, limit)).fetchall()
        return [AuditEntry(*row) for row in reversed(rows)]

    def gate_history(self, limit: int = 100) -> list[GateRecord]:
        """The newest `limit` gate results, oldest first."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT id, ts, stage, version, window_start, window_end, gate, verdict, value, threshold,"
                " dry_run, message FROM gate_results ORDER BY id DESC LIMIT ?", (limit,)).fetchall()
        records = []
        for (id_, ts, stage, version, start, end, gate, verdict, value, threshold, dry_run, message) in reversed(rows):
            records.append(GateRecord(id_, ts, stage, version, start, end, gate, verdict, value, threshold,
                                      bool(dry_run), message))
        return records

    def transition_counts(self) -> dict[str, int]:
        """How many transitions ended in each state, over the whole audit trail (a counter
        that survives restarts: what /metrics exports as spine_migration_transitions_total)."""
        with self._lock:
            rows = self._conn.execute("SELECT to_state, COUNT(*) FROM audit GROUP BY to_state").fetchall()
        return {state: count for state, count in rows}
