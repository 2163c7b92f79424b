"""The key store and the spend store notice when their sqlite file is removed or replaced under
them (`services.common.sqlite_file`): a write that would land in a deleted file is refused
with a message naming the file and what to do, not accepted and lost at the next restart."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from services.auth.key_store import SqliteKeyStore
from services.auth.managed_keys import ManagedKey
from services.common.sqlite_file import StoreFileGone
from services.ratelimit.spend_store import Bucket, SqliteSpendStore, Usage

BUCKET = Bucket("daily", time.strftime("%Y-%m-%d", time.gmtime()), "tenant", "dev")


def key(key_id: str) -> ManagedKey:
    return ManagedKey(id=key_id, tenant="dev", digest="00" * 32, shown="sk-…", created_at=time.time())


def remove(path: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        path.with_name(path.name + suffix).unlink(missing_ok=True)


def test_a_removed_key_store_refuses_writes_and_its_version_poll(tmp_path: Path) -> None:
    path = tmp_path / "keys.sqlite"
    store = SqliteKeyStore(path)
    try:
        assert store.create(key("a")) == 1
        remove(path)
        with pytest.raises(StoreFileGone, match=r"key store file .*keys\.sqlite was removed.*Restore the file"):
            store.create(key("b"))
        with pytest.raises(StoreFileGone):
            store.version()  # what auth polls: it reports the store down
        assert not path.exists()  # nothing was written behind the operator's back
    finally:
        store.close()


def test_a_key_store_replaced_by_another_file_is_not_written_either(tmp_path: Path) -> None:
    path = tmp_path / "keys.sqlite"
    store = SqliteKeyStore(path)
    other = SqliteKeyStore(tmp_path / "other.sqlite")
    try:
        store.create(key("a"))
        other.close()
        shutil.move(tmp_path / "other.sqlite", path)  # a restore of another file, say
        with pytest.raises(StoreFileGone, match="was replaced by another file"):
            store.create(key("b"))
    finally:
        store.close()


def test_a_lost_write_ahead_log_is_noticed(tmp_path: Path) -> None:
    path = tmp_path / "keys.sqlite"
    store = SqliteKeyStore(path)
    try:
        store.create(key("a"))
        store.version()  # the log is seen once there is one
        path.with_name("keys.sqlite-wal").unlink()
        with pytest.raises(StoreFileGone, match="write-ahead log"):
            store.create(key("b"))
    finally:
        store.close()


def test_a_removed_spend_store_refuses_the_exchange_so_the_charges_are_kept(tmp_path: Path) -> None:
    path = tmp_path / "spend.sqlite"
    store = SqliteSpendStore(path)
    try:
        assert store.exchange({BUCKET: Usage(usd=1.0, requests=1)}, [])[BUCKET].requests == 1
        remove(path)
        with pytest.raises(StoreFileGone, match="spend store file"):
            store.exchange({BUCKET: Usage(usd=1.0, requests=1)}, [])
    finally:
        store.close()


def test_a_store_left_in_place_keeps_working(tmp_path: Path) -> None:
    path = tmp_path / "keys.sqlite"
    store = SqliteKeyStore(path)
    try:
        for i in range(5):
            store.create(key(f"k{i}"))
            assert store.version() == i + 1
    finally:
        store.close()
