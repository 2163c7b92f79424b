"""Durable rollout state: one status row, the gate history, the audit trail and the lease.

In sqlite (the embedded default: WAL with `synchronous=FULL`, a committed transition
survives a power cut) or PostgreSQL (several controller replicas sharing one store,
`migration.leadership`). Either way every transition is ONE transaction that writes the
status row and its audit row together: after a crash the status never disagrees with the
audit trail that explains it. With a leader elected, that same transaction is fenced: it
commits only while the writer's lease epoch is the current one.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterable
from dataclasses import astuple, fields

from migration.gates import GateResult
from migration.lease import Fenced, LeaseRecord
from migration.status import AuditEntry, GateRecord, RolloutStatus, State
from migration.store_backends import Backend, Transaction, open_backend

__all__ = ["Fenced", "LeaseRecord", "Store"]

log = logging.getLogger("spine.migration")
_STATUS_COLUMNS = [f.name for f in fields(RolloutStatus)]
_LEASE_COLUMNS = "holder, address, epoch, acquired_at, renewed_at, duration_s"


class Store:
    """The controller's state in a database (`migration.store_backends`): thread-safe, and
    fenced once `fence_with` names this writer's lease epoch.

    Fenced, every write (a transition, window bookkeeping) reads the lease row under its
    lock in the same transaction and commits only while that epoch is current and live;
    otherwise it raises `Fenced` and commits nothing. `check_fence` is the same check
    alone, for what must not happen unless this controller still leads (pushing a stage
    to the data path, before the write that records it).
    """

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._fence: tuple[str, int] | None = None
        self._elected = False
        self._lock = threading.Lock()
        self.fenced_writes = 0  # writes refused by the fence (spine_migration_fenced_writes_total)

    @classmethod
    def open(cls, location: str | os.PathLike[str]) -> Store:
        """A PostgreSQL DSN (postgresql://…) or a sqlite file path."""
        return cls(open_backend(os.fspath(location)))

    @property
    def backend(self) -> str:
        return self._backend.name

    def close(self) -> None:
        self._backend.close()

    def pragma(self, name: str) -> object:
        """A PRAGMA's current value (for checks that durability settings took; sqlite only)."""
        return self._backend.pragma(name)

    # --- the lease -------------------------------------------------------------------------

    def elected(self) -> None:
        """From now on only a writer holding the current lease epoch may write."""
        self._elected = True

    def fence_with(self, holder: str, epoch: int | None) -> None:
        """Write as `holder` at lease `epoch` (None: this store's writer holds no lease)."""
        with self._lock:
            self._fence = (holder, epoch) if epoch is not None else None

    def lease(self) -> LeaseRecord | None:
        rows = self._backend.query(f"SELECT {_LEASE_COLUMNS}, {self._backend.now_sql} FROM leader_lease WHERE id = 1")
        return LeaseRecord(*rows[0]) if rows else None

    def try_acquire(self, holder: str, address: str, duration_s: float, held_epoch: int | None) -> LeaseRecord:
        """Renew the lease (`held_epoch` is still the current one), take it (it is free or
        expired: one more epoch), or leave it to its holder; the lease as it stands after.

        A holder that lost track of its epoch (`held_epoch` None: it gave up, or restarted
        under the same name) does not get it back by name: it waits for it to expire and
        takes a new epoch, so whatever it did before is fenced off like anyone else's."""
        now_sql = self._backend.now_sql
        with self._backend.transaction() as tx:
            row = tx.execute(f"SELECT {_LEASE_COLUMNS}, {now_sql} FROM leader_lease WHERE id = 1"
                             f"{self._backend.lock_lease}").fetchone()
            current = LeaseRecord(*row) if row else None
            if current is not None and current.holder == holder and current.epoch == held_epoch:
                tx.execute(f"UPDATE leader_lease SET renewed_at = {now_sql}, duration_s = ?, address = ? WHERE id = 1",
                           (duration_s, address))
            elif current is None:
                tx.execute(f"INSERT INTO leader_lease (id, {_LEASE_COLUMNS})"
                           f" VALUES (1, ?, ?, 1, {now_sql}, {now_sql}, ?)", (holder, address, duration_s))
            elif not current.live:
                tx.execute(f"UPDATE leader_lease SET holder = ?, address = ?, epoch = epoch + 1, acquired_at = {now_sql},"
                           f" renewed_at = {now_sql}, duration_s = ? WHERE id = 1", (holder, address, duration_s))
            else:
                return current
            row = tx.execute(f"SELECT {_LEASE_COLUMNS}, {now_sql} FROM leader_lease WHERE id = 1").fetchone()
            return LeaseRecord(*row).claimed()

    def release(self, holder: str, epoch: int) -> None:
        """Give the lease up now (a clean stop): the next replica need not wait it out."""
        with self._backend.transaction() as tx:
            tx.execute("UPDATE leader_lease SET renewed_at = 0 WHERE id = 1 AND holder = ? AND epoch = ?",
                       (holder, epoch))

    def check_fence(self) -> None:
        """Raise `Fenced` unless this writer holds the current, live lease (no-op unelected)."""
        if self._elected:
            with self._backend.transaction() as tx:
                self._fenced(tx)

    def _fenced(self, tx: Transaction) -> None:
        """Inside a writing transaction: refuse it unless our epoch is current and live."""
        if not self._elected:
            return
        row = tx.execute(f"SELECT {_LEASE_COLUMNS}, {self._backend.now_sql} FROM leader_lease WHERE id = 1"
                         f"{self._backend.lock_lease}").fetchone()
        current = LeaseRecord(*row) if row else None
        fence = self._fence
        if (fence is not None and current is not None and current.live
                and (current.holder, current.epoch) == fence):
            return
        with self._lock:
            self.fenced_writes += 1
            refused = self.fenced_writes
        leader = current if current is not None and current.live else None
        mine = (f"its lease epoch {fence[1]} is no longer the current one" if fence
                else "this controller does not hold the lease")
        now = f"{leader.describe()} leads" if leader else "no controller holds a live lease"
        message = f"write refused: {mine}; {now}"
        log.warning("%s (%d write(s) refused so far)", message, refused)
        raise Fenced(message, leader)

    # --- the rollout ---------------------------------------------------------------------

    def load(self) -> RolloutStatus | None:
        rows = self._backend.query(f"SELECT {', '.join(_STATUS_COLUMNS)} FROM rollout WHERE id = 1")
        if not rows:
            return None
        values = dict(zip(_STATUS_COLUMNS, rows[0], strict=True))
        values["state"] = State(values["state"])
        values["placements"] = json.loads(values["placements"])
        values["acked"] = bool(values["acked"])
        return RolloutStatus(**values)

    def save(self, status: RolloutStatus, *, audit: tuple[str, str, str, str, str] | None = None,
             gates: Iterable[tuple[GateResult, str, float, float]] = ()) -> int | None:
        """Write the status row, plus (in the same transaction) an audit row and gate results.

        `audit` is (actor, action, from_state, stage, reason); its to_state is the status's
        state. `gates` are (result, stage name, window start, window end). Returns the audit
        row id when one was written. Fenced (see the class), it first checks the lease in
        the same transaction and raises `Fenced`, writing nothing, when it is not ours.
        """
        values = list(astuple(status))
        values[_STATUS_COLUMNS.index("placements")] = json.dumps(status.placements, sort_keys=True)
        values[_STATUS_COLUMNS.index("state")] = str(status.state)
        values[_STATUS_COLUMNS.index("acked")] = int(status.acked)
        placeholders = ", ".join("?" for _ in _STATUS_COLUMNS)
        updates = ", ".join(f"{column} = excluded.{column}" for column in _STATUS_COLUMNS)
        audit_id = None
        with self._backend.transaction() as tx:
            self._fenced(tx)
            tx.execute(f"INSERT INTO rollout (id, {', '.join(_STATUS_COLUMNS)}) VALUES (1, {placeholders})"
                       f" ON CONFLICT (id) DO UPDATE SET {updates}", values)
            for result, stage, start, end in gates:
                tx.execute(
                    "INSERT INTO gate_results (ts, stage, version, window_start, window_end, gate, verdict,"
                    " value, threshold, dry_run, message) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (end, stage, status.version, start, end, result.gate, str(result.verdict), result.value,
                     result.threshold, int(result.dry_run), result.message),
                )
            if audit is not None:
                actor, action, from_state, stage, reason = audit
                audit_id = int(tx.execute(
                    "INSERT INTO audit (ts, actor, action, from_state, to_state, stage, reason)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING id",
                    (status.updated_at, actor, action, from_state, str(status.state), stage, reason),
                ).fetchone()[0])
        return audit_id

    def audit(self, after_id: int = 0, limit: int = 1000) -> list[AuditEntry]:
        """Audit rows with id > after_id, oldest first."""
        rows = self._backend.query(
            "SELECT id, ts, actor, action, from_state, to_state, stage, reason FROM audit"
            " WHERE id > ? ORDER BY id LIMIT ?", (after_id, limit))
        return [AuditEntry(*row) for row in rows]

    def recent_audit(self, limit: int) -> list[AuditEntry]:
        """The newest `limit` audit rows, oldest first."""
        rows = self._backend.query(
            "SELECT id, ts, actor, action, from_state, to_state, stage, reason FROM audit"
            " ORDER BY id DESC LIMIT ?", (limit,))
        return [AuditEntry(*row) for row in reversed(rows)]

    def audit_of(self, actions: Iterable[str], limit: int) -> list[AuditEntry]:
        """The newest `limit` audit rows of these actions, oldest first (the dashboard's runs)."""
        wanted = sorted(set(actions))
        rows = self._backend.query(
            "SELECT id, ts, actor, action, from_state, to_state, stage, reason FROM audit"
            f" WHERE action IN ({', '.join('?' for _ in wanted)}) ORDER BY id DESC LIMIT ?",
            (*wanted, limit))
        return [AuditEntry(*row) for row in reversed(rows)]

    def gate_history(self, limit: int = 100) -> list[GateRecord]:
        """The newest `limit` gate results, oldest first."""
        rows = self._backend.query(
            "SELECT id, ts, stage, version, window_start, window_end, gate, verdict, value, threshold,"
            " dry_run, message FROM gate_results ORDER BY id DESC LIMIT ?", (limit,))
        records = []
        for (id_, ts, stage, version, start, end, gate, verdict, value, threshold, dry_run, message) in reversed(rows):
            records.append(GateRecord(id_, ts, stage, version, start, end, gate, verdict, value, threshold,
                                      bool(dry_run), message))
        return records

    def transition_counts(self) -> dict[str, int]:
        """How many transitions ended in each state, over the whole audit trail (a counter
        that survives restarts: what /metrics exports as spine_migration_transitions_total)."""
        rows = self._backend.query("SELECT to_state, COUNT(*) FROM audit GROUP BY to_state")
        return {state: int(count) for state, count in rows}
