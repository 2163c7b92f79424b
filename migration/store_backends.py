"""The two databases a controller's state can live in, behind one small interface.

sqlite is the embedded default (one controller, or several on one machine sharing the
file); PostgreSQL is what several replicas on several machines share. `migration.state_store`
writes its SQL once, in the subset both speak (`?` placeholders, `ON CONFLICT` upserts,
`RETURNING`); a backend only opens transactions, translates placeholders and names the few
things that differ: the schema's types, the database's clock and how a row is locked.

Each transaction takes the lease row's lock first where it must (`lock_lease`), so a
fenced write and a takeover never interleave: sqlite's `BEGIN IMMEDIATE` holds the whole
file's write lock from the start, PostgreSQL's `SELECT … FOR UPDATE` the lease row's.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Protocol

from services.common import sqlite_file

log = logging.getLogger("spine.migration")

_TABLES = """
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
    id SERIAL_ID,
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
    id SERIAL_ID,
    ts REAL NOT NULL,
    actor TEXT NOT NULL,
    action TEXT NOT NULL,
    from_state TEXT NOT NULL,
    to_state TEXT NOT NULL,
    stage TEXT NOT NULL,
    reason TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS leader_lease (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    holder TEXT NOT NULL,
    address TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    acquired_at REAL NOT NULL,
    renewed_at REAL NOT NULL,
    duration_s REAL NOT NULL
);
"""


class StoreUnavailable(RuntimeError):
    """The store did not answer (a restart, a network fault, a lock held too long): nothing
    was committed; the caller retries later."""


class Transaction(Protocol):
    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any: ...


class Backend(Protocol):
    """Where the tables live; every method is thread-safe."""

    name: str
    now_sql: str  # the database's clock, Unix seconds (the lease is timed by it, not by any replica's)
    lock_lease: str  # appended to the SELECT that reads the lease row inside a writing transaction

    def transaction(self) -> AbstractContextManager[Transaction]: ...  # commits, or rolls back on error
    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]: ...  # a read, no lock
    def close(self) -> None: ...
    def pragma(self, name: str) -> object: ...


class _SqliteTransaction:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        return self._conn.execute(sql, params)


class SqliteBackend:
    """A sqlite file: WAL with `synchronous=FULL` (a committed transition survives a power
    cut); several processes on one machine may share it, one writer at a time."""

    name = "sqlite"
    now_sql = "((julianday('now') - 2440587.5) * 86400.0)"
    lock_lease = ""  # BEGIN IMMEDIATE already holds the file's write lock

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._conn = sqlite_file.connect(Path(self.path), timeout_s=5.0, synchronous="FULL")
        self._conn.executescript(_TABLES.replace("SERIAL_ID", "INTEGER PRIMARY KEY AUTOINCREMENT"))
        self._lock = threading.RLock()

    @contextmanager
    def transaction(self) -> Iterator[Transaction]:
        with self._lock:
            try:
                self._conn.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as error:  # another process held the write lock too long
                raise StoreUnavailable(f"sqlite {self.path}: {error}") from None
            try:
                yield _SqliteTransaction(self._conn)
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            try:
                return list(self._conn.execute(sql, params).fetchall())
            except sqlite3.OperationalError as error:
                raise StoreUnavailable(f"sqlite {self.path}: {error}") from None

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def pragma(self, name: str) -> object:
        with self._lock:
            return self._conn.execute(f"PRAGMA {name}").fetchone()[0]


class _PostgresTransaction:
    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        return self._conn.execute(sql.replace("?", "%s"), tuple(params))


class PostgresBackend:
    """A PostgreSQL database shared by every controller replica (psycopg 3).

    One connection, opened again when the server went away (a restart, a failover): the
    transaction that saw it go fails (the caller retries at its next tick), the next one
    reconnects. Statements time out rather than hang on a server that stopped answering.
    """

    name = "postgresql"
    now_sql = "extract(epoch from clock_timestamp())::double precision"
    lock_lease = " FOR UPDATE"

    def __init__(self, dsn: str, *, statement_timeout_ms: int = 5000, lock_timeout_ms: int = 3000,
                 idle_in_transaction_ms: int = 3000, connect_timeout_s: int = 3) -> None:
        self._dsn = dsn
        # A replica paused inside a transaction (SIGSTOP, a long GC) holds the lease row's lock:
        # the server ends its session after `idle_in_transaction_ms` (its transaction rolls
        # back), and no one waits longer than `lock_timeout_ms` for a lock meanwhile.
        self._options = (f"-c statement_timeout={statement_timeout_ms} -c lock_timeout={lock_timeout_ms} "
                         f"-c idle_in_transaction_session_timeout={idle_in_transaction_ms}")
        self._connect_timeout_s = connect_timeout_s
        self._lock = threading.RLock()
        self._conn: Any = None
        with self.transaction() as tx:
            # Two replicas starting together may both create the tables: serialize on a lock.
            tx.execute("SELECT pg_advisory_xact_lock(7170)")
            for statement in _TABLES.replace("SERIAL_ID", "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY") \
                    .replace(" REAL", " DOUBLE PRECISION").split(";"):
                if statement.strip():
                    tx.execute(statement)

    def _connection(self) -> Any:
        import psycopg

        if self._conn is None or self._conn.closed or self._conn.broken:
            if self._conn is not None:
                self._conn.close()
            self._conn = psycopg.connect(self._dsn, connect_timeout=self._connect_timeout_s, autocommit=True,
                                         options=self._options)
        return self._conn

    @contextmanager
    def transaction(self) -> Iterator[Transaction]:
        import psycopg

        with self._lock:
            try:
                conn = self._connection()
                with conn.transaction():
                    yield _PostgresTransaction(conn)
            except (psycopg.OperationalError, psycopg.InterfaceError) as error:
                # The message names the server, never the DSN's password.
                first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                raise StoreUnavailable(f"PostgreSQL: {first}") from None

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self.transaction() as tx:
            return list(tx.execute(sql, params).fetchall())

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()

    def pragma(self, name: str) -> object:
        raise NotImplementedError("PRAGMA is sqlite's; PostgreSQL's settings are read with SHOW")


def is_postgres(location: str) -> bool:
    return location.startswith(("postgresql://", "postgres://"))


def carries_password(dsn: str) -> bool:
    from psycopg.conninfo import conninfo_to_dict

    try:
        return bool(conninfo_to_dict(dsn).get("password"))
    except Exception:  # malformed: psycopg says so when it connects
        return False


def redacted(location: str) -> str:
    """A store location fit for a log line: a DSN's password replaced."""
    if not is_postgres(location):
        return location
    from psycopg.conninfo import conninfo_to_dict

    try:
        parts = conninfo_to_dict(location)
    except Exception:  # a malformed DSN: say nothing of it beyond its scheme
        return location.split("://", 1)[0] + "://…"
    host, port, db = parts.get("host", ""), parts.get("port", ""), parts.get("dbname", "")
    return f"postgresql://{parts.get('user', '')}@{host}{':' + str(port) if port else ''}/{db}"


def open_backend(location: str) -> Backend:
    """A PostgreSQL DSN (postgresql://…), else a sqlite file path."""
    if is_postgres(location):
        return PostgresBackend(location)
    return SqliteBackend(location)
