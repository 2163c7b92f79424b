"""A store's sqlite file, and a check that it is still the file at its path.

Every sqlite store of the spine (API keys, spend, the migration's state) opens its file with
`connect`: one connection shared by the store's threads under the store's own lock, in
autocommit mode (a store says BEGIN itself), in WAL mode so that the processes of one machine
read while one writes.

The key store and the spend store each keep one connection open for the life of the process.
If their files are removed while it runs (a cleanup of the run directory, a volume swapped,
`rm` by hand), sqlite does not notice: the open descriptors still name the deleted inodes, so
every write succeeds, every read agrees with it, and all of it is gone at the next restart.
So the store records which file it opened (device and inode, of the database and of its
write-ahead log once there is one) and `check` compares them with what the path names now:
a write that could not be kept is refused (`StoreFileGone`, whose message says what happened
and what to do), and the pollers that call `check` report the store down.

Two `stat` calls a check: cheap next to the transaction they guard, and the pollers run a
few times a second at most.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

Identity = tuple[int, int]  # (st_dev, st_ino)


class StoreFileGone(Exception):
    """The store's file was removed or replaced while this process had it open; the message is
    an operator's to act on (safe to show an admin: it names a path, nothing secret)."""


def connect(path: Path, timeout_s: float, *, synchronous: str = "") -> sqlite3.Connection:
    """A connection to the sqlite file at `path` (made with its folder when missing), in WAL
    mode; `synchronous` sets that PRAGMA (FULL: a committed transaction survives a power cut)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(str(path), timeout=timeout_s, isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    if synchronous:
        db.execute(f"PRAGMA synchronous={synchronous}")
    return db


class SqliteFile:
    """One connection to the sqlite file at `path` (WAL; made with its folder when missing),
    shared by a store's threads under the store's own lock."""

    def __init__(self, path: Path, what: str, timeout_s: float = 2.0) -> None:
        self.path = path
        self.what = what  # "key store", "spend store": how the messages name it
        self.db = connect(path, timeout_s)
        self._opened = _identity(path)
        self._wal: Identity | None = None  # the log's, from the first check that finds one

    def check(self) -> None:
        """Raise StoreFileGone unless the path (and its write-ahead log) are still the files
        this connection writes to."""
        now = _identity(self.path)
        if now != self._opened:
            self._gone("was removed" if now is None else "was replaced by another file")
        wal = _identity(self._wal_path)
        if self._wal is None:
            self._wal = wal
        elif wal != self._wal:  # this connection keeps it open: sqlite never removes it meanwhile
            self._gone("has lost its write-ahead log (-wal)" if wal is None else "has a replaced write-ahead log")

    @property
    def _wal_path(self) -> Path:
        return self.path.with_name(self.path.name + "-wal")

    def _gone(self, happened: str) -> None:
        raise StoreFileGone(
            f"the {self.what} file {self.path} {happened} while this process had it open: what it writes now "
            "would be lost at the next restart, so writes are refused. Restore the file (from a backup, or the "
            "replica that still has it) and restart this process, which opens it again")

    def close(self) -> None:
        self.db.close()


def _identity(path: Path) -> Identity | None:
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return stat.st_dev, stat.st_ino
