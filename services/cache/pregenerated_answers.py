"""The table a cache process serves from (`cache.pregenerated`), and how it is swapped.

Swapping is by file watch, not SIGHUP: the layered cache child, the spine and every
replica notice a new file by themselves, with nothing to signal. Replace the file by an
atomic rename (`spine cache build` writes a temporary file and renames it); at most
`cache.pregenerated_check_s` later, a lookup sees the path's inode, size or mtime changed
and a background thread maps and checks the new file, then swaps the reference. Lookups
in flight keep the table they took, so no request is dropped or answered from half a file.

A file that cannot be served (missing, truncated, corrupt, another format, another model)
gets one log line — once per file, not per check — and the process serves without it, or
keeps the table it had when a replacement is bad.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from services.cache.pregenerated import PregeneratedTable, TableError, describe, table_key
from wire.v1 import generation_pb2

log = logging.getLogger("spine.cache")

_Identity = tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns


def _identity(path: Path) -> _Identity | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


class PregeneratedAnswers:
    """The current table of one path; `lookup` answers greedy requests from it."""

    def __init__(self, path: str | Path, expected: Mapping[str, bytes], check_every_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = Path(path)
        self._expected = dict(expected)
        self._every = check_every_s
        self._clock = clock
        self._table: PregeneratedTable | None = None
        self._identity: _Identity | None = None
        self._next_check = clock() + check_every_s
        self._loading = threading.Lock()
        self.swaps = 0  # tables mapped after the first (tests and logs)
        self._load(_identity(self.path), first=True)

    @property
    def table(self) -> PregeneratedTable | None:
        return self._table

    def lookup(self, request: generation_pb2.GenerateRequest) -> generation_pb2.GenerateResponse | None:
        """The stored answer of a greedy request (`request.model` resolved), or None."""
        if self._clock() >= self._next_check:
            self._watch()
        table = self._table  # one reference for the whole lookup: a swap cannot change it midway
        # A chat's messages (`GenerateRequest.messages`) may read otherwise than its prompt
        # through a template: the table, built from prompts, answers only plain requests.
        if table is None or request.temperature != 0.0 or request.model != table.model_id or request.messages:
            return None
        return table.lookup(table_key(request.model, request.system, request.prompt, request.max_tokens))

    def _watch(self) -> None:
        self._next_check = self._clock() + self._every
        identity = _identity(self.path)
        if identity == self._identity or not self._loading.acquire(blocking=False):
            return
        self._identity = identity  # this file is tried once, whatever comes of it
        threading.Thread(target=self._reload, args=(identity,), name="pregenerated-reload", daemon=True).start()

    def _reload(self, identity: _Identity | None) -> None:
        try:
            self._load(identity, first=False)
        finally:
            self._loading.release()

    def _load(self, identity: _Identity | None, *, first: bool) -> None:
        self._identity = identity
        keeping = "" if self._table is None else "; keeping the previous table"
        if identity is None:
            log.error("cache.pregenerated %s: refused (no such file); serving without it%s", self.path, keeping)
            return
        try:
            table = PregeneratedTable(self.path, self._expected)
        except (TableError, OSError, ValueError) as error:
            log.error("cache.pregenerated %s: refused (%s); serving without it%s", self.path, error, keeping)
            return
        self._table = table  # the old table is unmapped when the last lookup holding it is done
        if not first:
            self.swaps += 1
        log.info("cache.pregenerated: %s table %s", "mapped" if first else "swapped in", describe(table))
