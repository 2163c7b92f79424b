"""A replica's copy of the managed keys: looked up in memory, kept current by polling the store.

Auth never asks the store per request: it looks a credential's HMAC up in a dict built from
the last load, and confirms the hit with `hmac.compare_digest`. A thread of its own reads the
store's version every `poll_s` (one small read) and loads the records again when it moved,
so a key made, changed or revoked on any replica is seen by every other within one poll
interval (0.2 s by default), whichever process auth runs in.

When the store cannot be read, the copy in memory keeps serving: keys keep working and a
key revoked before the outage stays refused; a change made during it is seen at the first
poll that answers. The outage is logged once per transition and counted on /metrics
(`spine_auth_key_store_*`), with how stale the copy is, and named in auth's health reason
(`health`). A sqlite file removed or replaced under the process is such an outage: its poll
fails (`services.common.sqlite_file`) rather than reading on from the deleted file.

Expiry and the overlap of a rotated key are checked on every lookup against the clock, not
at the next poll, so a key stops working at its time to the millisecond.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from services.auth.key_store import KeyStore
from services.auth.managed_keys import KeyHasher, ManagedKey
from services.common import Clock
from services.common.collectors import by_label, counter, gauge, read_at_scrape
from services.common.thread_names import name_os_thread

log = logging.getLogger("spine.auth")


@dataclass(frozen=True)
class _Entry:
    key: ManagedKey
    digest: bytes
    until: float  # 0: as long as the key is active; else the end of a rotated key's overlap


class LiveKeys:
    """The managed keys as this process last read them from `store`."""

    def __init__(self, store: KeyStore, hasher: KeyHasher, poll_s: float = 0.2, clock: Clock = time.time) -> None:
        self.store = store
        self._hasher = hasher
        self._poll_s = poll_s
        self._clock = clock
        self._by_digest: dict[bytes, _Entry] = {}
        self._count = 0
        self.version = -1  # the store's version this copy was read at (-1: never read)
        self.reachable = False
        self.problem = ""  # why the store could not be read, at the last poll that failed
        self.loaded_at = 0.0  # monotonic time of the last successful read
        self.polls = {"ok": 0, "error": 0}
        self.reloads = 0
        self.outages = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="auth-keys", daemon=True)

    def start(self) -> LiveKeys:
        self.poll()  # before the first request: the keys are there from the start when the store is
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self._poll_s + 2.0)
        self.store.close()

    # -- lookups --------------------------------------------------------------------------
    def lookup(self, credential: str) -> ManagedKey | None:
        """The active key `credential` is (a rotated key's old value until its overlap ends), or None."""
        if not self._by_digest:  # no managed key: nothing to hash for
            return None
        digest = self._hasher.raw(credential)
        entry = self._by_digest.get(digest)
        if entry is None or not hmac.compare_digest(entry.digest, digest):
            return None
        now = self._clock()
        if entry.key.state(now) != "active" or (entry.until and entry.until <= now):
            return None
        return entry.key

    def __len__(self) -> int:
        return self._count

    # -- keeping current ------------------------------------------------------------------
    def _run(self) -> None:
        name_os_thread()
        while not self._stop.wait(self._poll_s):
            self.poll()

    def poll(self) -> None:
        """Read the store's version; load every record when it moved. Never raises."""
        try:
            version = self.store.version()
            if version != self.version:
                version, keys = self.store.load()
                self._install(version, keys)
        except Exception as error:  # redis.RedisError, sqlite3.Error, OSError: serve from the copy
            self.polls["error"] += 1
            if self.reachable or self.version < 0:
                self.outages += 1
                log.warning("key store %s unreadable (%s: %s); serving the %d keys read %s",
                            getattr(self.store, "where", "?"), type(error).__name__, error, self._count,
                            "before" if self.version >= 0 else "from the config file alone")
            self.reachable = False
            self.problem = f"{type(error).__name__}: {error}"
            return
        self.polls["ok"] += 1
        if not self.reachable and self.version >= 0 and self.outages:
            log.warning("key store %s readable again (version %d)", getattr(self.store, "where", "?"), self.version)
        self.reachable = True
        self.loaded_at = time.monotonic()

    def _install(self, version: int, keys: list[ManagedKey]) -> None:
        table: dict[bytes, _Entry] = {}
        for key in keys:
            if key.revoked_at:
                continue
            table[bytes.fromhex(key.digest)] = _Entry(key, bytes.fromhex(key.digest), 0.0)
            if key.previous_digest and key.previous_until:
                old = bytes.fromhex(key.previous_digest)
                table[old] = _Entry(key, old, key.previous_until)
        self._by_digest = table  # one assignment: a lookup sees the old table or the new, never half
        self._count = sum(1 for key in keys if not key.revoked_at)
        self.version = version
        self.reloads += 1

    # -- health and metrics ---------------------------------------------------------------
    def staleness_s(self) -> float:
        """Seconds since the copy was last confirmed current (0 while the store answers)."""
        if self.reachable:
            return 0.0
        return time.monotonic() - self.loaded_at if self.loaded_at else float("inf")

    def describe(self) -> str:
        where = getattr(self.store, "where", "the key store")
        if self.reachable:
            return f"{self._count} managed keys from {where} (version {self.version})"
        return f"{where} unreadable ({self.problem}): serving the {self._count} managed keys read before"

    def health(self) -> tuple[bool, str]:
        """Auth's health as the gateway reports it: serving either way (the copy in memory
        decides), and the reason says whether the store behind it is there."""
        return True, f"local: {self.describe()}"

    def collector(self) -> Collector:
        return read_at_scrape(self._families)

    def _families(self) -> Iterator[Metric]:
        staleness = self.staleness_s()
        yield gauge("spine_auth_key_store_up", "1 while the managed key store answers, 0 while auth serves from its "
                    "last copy", 1.0 if self.reachable else 0.0)
        yield by_label(CounterMetricFamily, "spine_auth_key_store_polls", "Reads of the key store's version",
                       "result", self.polls)
        yield counter("spine_auth_key_store_outages", "Times the key store became unreadable", self.outages)
        yield counter("spine_auth_key_store_reloads", "Times the managed keys were loaded again", self.reloads)
        yield gauge("spine_auth_key_store_stale_seconds", "Seconds the copy of the managed keys has gone "
                    "unconfirmed (0: current)", staleness if staleness != float("inf") else -1.0)
        yield gauge("spine_auth_managed_keys", "Managed keys that are not revoked, as last read", len(self))
        yield gauge("spine_auth_key_store_version", "The key store's version as last read", self.version)
