"""Where managed keys live: Redis (replicas share it) or a sqlite file (one machine's processes).

Both keep the records (JSON, hashes only) and one *version* number that every change bumps
in the same atomic step. A replica polls that number (`services.auth.live_keys`), a single
read, and loads the records again only when it moved: every replica sees a change within
one poll interval, and an unchanged store costs one tiny read per interval.

Writes are conditional: a new key fails if its id is taken, and an update names the record
version it read, so two admins changing one key at once cannot lose a change silently (the
second is told to read again).
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from pathlib import Path
from typing import Protocol

from services.auth.config import KeyStoreSection
from services.auth.managed_keys import KeyHasher, ManagedKey
from services.common.admin_token import read_secret_file
from services.common.redis_link import RedisLink, connect
from services.common.sqlite_file import SqliteFile

SQLITE_FILE = "keys.sqlite"


class KeyStoreError(Exception):
    """A write the store refused; the message is safe to show an admin."""


class KeyExists(KeyStoreError):
    pass


class KeyConflict(KeyStoreError):
    pass


class KeyStore(Protocol):
    def version(self) -> int:
        """The store's change counter (0 for an empty store)."""
        ...

    def load(self) -> tuple[int, list[ManagedKey]]:
        """The version and every record, read together."""
        ...

    def get(self, key_id: str) -> ManagedKey | None: ...

    def create(self, key: ManagedKey) -> int:
        """Add `key` (KeyExists when its id is taken); the new version."""
        ...

    def update(self, key: ManagedKey, read_version: int) -> int:
        """Replace the record of `key.id`, which must still be at `read_version` (KeyConflict
        otherwise, KeyStoreError when there is none); the new version."""
        ...

    def close(self) -> None: ...


# KEYS: records, version. ARGV: id, record, expected record version ('' for a new key).
# Returns the store's new version, -1 when the id is taken (create) or the record moved on
# (update), -2 when there is no such record.
_WRITE = """
local current = redis.call('HGET', KEYS[1], ARGV[1])
if ARGV[3] == '' then
  if current then return -1 end
else
  if not current then return -2 end
  if tostring(cjson.decode(current)['version']) ~= ARGV[3] then return -1 end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return redis.call('INCR', KEYS[2])
"""


class RedisKeyStore:
    """Records in one hash (`<prefix>records`), the version in `<prefix>version`."""

    def __init__(self, link: RedisLink) -> None:
        self._redis = connect(link)
        self._records = f"{link.key_prefix}records"
        self._version = f"{link.key_prefix}version"
        self._write = self._redis.register_script(_WRITE)
        self.where = f"redis {link.address} ({link.key_prefix}*)"

    def version(self) -> int:
        return int(self._redis.get(self._version) or 0)

    def load(self) -> tuple[int, list[ManagedKey]]:
        pipe = self._redis.pipeline(transaction=True)  # MULTI: the version and the records of one moment
        pipe.get(self._version)
        pipe.hvals(self._records)
        version, raw = pipe.execute()
        return int(version or 0), [ManagedKey.from_json(r) for r in raw]

    def get(self, key_id: str) -> ManagedKey | None:
        raw = self._redis.hget(self._records, key_id)
        return None if raw is None else ManagedKey.from_json(raw)

    def create(self, key: ManagedKey) -> int:
        return self._written(self._write(keys=[self._records, self._version], args=[key.id, key.to_json(), ""]), key)

    def update(self, key: ManagedKey, read_version: int) -> int:
        answer = self._write(keys=[self._records, self._version], args=[key.id, key.to_json(), str(read_version)])
        return self._written(answer, key, updating=True)

    @staticmethod
    def _written(answer: int, key: ManagedKey, updating: bool = False) -> int:
        if answer == -2:
            raise KeyStoreError(f"no key {key.id!r}")
        if answer == -1:
            if updating:
                raise KeyConflict(f"key {key.id!r} was changed meanwhile; read it again and retry")
            raise KeyExists(f"a key with id {key.id!r} exists already")
        return int(answer)

    def close(self) -> None:
        self._redis.close()


class SqliteKeyStore:
    """Records in a sqlite file (WAL: the processes of one machine read while one writes).

    A file removed or replaced while the process runs (`services.common.sqlite_file`) fails
    the version's poll (auth reports the store down and serves the keys it holds) and every
    write, with `StoreFileGone`: a key made into a deleted file would work until the restart
    and then be gone."""

    def __init__(self, path: Path, timeout_s: float = 2.0) -> None:
        self._file = SqliteFile(path, "key store", timeout_s)
        self._db = self._file.db
        self._lock = threading.Lock()
        self.where = f"sqlite {path}"
        with self._lock:
            self._db.execute("CREATE TABLE IF NOT EXISTS keys (id TEXT PRIMARY KEY, record TEXT NOT NULL)")
            self._db.execute("CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL)")
            self._db.execute("INSERT OR IGNORE INTO meta VALUES ('version', 0)")

    def version(self) -> int:
        with self._lock:
            self._file.check()
            return int(self._db.execute("SELECT value FROM meta WHERE name = 'version'").fetchone()[0])

    def load(self) -> tuple[int, list[ManagedKey]]:
        with self._lock:
            self._db.execute("BEGIN")
            try:
                version = int(self._db.execute("SELECT value FROM meta WHERE name = 'version'").fetchone()[0])
                rows = self._db.execute("SELECT record FROM keys").fetchall()
            finally:
                self._db.execute("COMMIT")
        return version, [ManagedKey.from_json(row[0]) for row in rows]

    def get(self, key_id: str) -> ManagedKey | None:
        with self._lock:
            row = self._db.execute("SELECT record FROM keys WHERE id = ?", (key_id,)).fetchone()
        return None if row is None else ManagedKey.from_json(row[0])

    def create(self, key: ManagedKey) -> int:
        return self._write(key, None)

    def update(self, key: ManagedKey, read_version: int) -> int:
        return self._write(key, read_version)

    def _write(self, key: ManagedKey, read_version: int | None) -> int:
        with self._lock:
            self._file.check()
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute("SELECT record FROM keys WHERE id = ?", (key.id,)).fetchone()
                if read_version is None and row is not None:
                    raise KeyExists(f"a key with id {key.id!r} exists already")
                if read_version is not None:
                    if row is None:
                        raise KeyStoreError(f"no key {key.id!r}")
                    if ManagedKey.from_json(row[0]).version != read_version:
                        raise KeyConflict(f"key {key.id!r} was changed meanwhile; read it again and retry")
                self._db.execute("INSERT OR REPLACE INTO keys VALUES (?, ?)", (key.id, key.to_json().decode()))
                self._db.execute("UPDATE meta SET value = value + 1 WHERE name = 'version'")
                version = int(self._db.execute("SELECT value FROM meta WHERE name = 'version'").fetchone()[0])
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
        return version

    def close(self) -> None:
        with self._lock:
            self._file.close()


def open_key_store(section: KeyStoreSection, run_dir: Path) -> tuple[KeyStore, KeyHasher]:
    """The store `section` names and the hasher of its secret (the run directory's sqlite file
    and a secret made beside it when the section names neither)."""
    if section.redis is not None:
        assert section.hmac_secret_file is not None  # the section's validator insists
        return RedisKeyStore(section.redis), _hasher(section.hmac_secret_file, make=False)
    path = section.sqlite or run_dir / SQLITE_FILE
    secret_file = section.hmac_secret_file or path.with_suffix(".secret")
    return SqliteKeyStore(path), _hasher(secret_file, make=section.hmac_secret_file is None)


def _hasher(path: Path, *, make: bool) -> KeyHasher:
    """The secret in `path` (refused when others can read it); made there first when `make`
    and it does not exist yet (O_EXCL: two processes starting at once agree on one)."""
    if make:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w") as out:
                out.write(secrets.token_hex(32))
    secret = ""
    for _ in range(50):  # a file another process just made may be empty for a moment
        secret = read_secret_file(str(path), "auth.store.hmac_secret_file")
        if secret:
            break
        time.sleep(0.01)
    return KeyHasher(secret.encode())
