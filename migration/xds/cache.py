"""Snapshots per node id, with a default for every node, and watchers told of changes.

The application (the migration controller) only builds snapshots and sets them here; the ADS
server only reads them. Keeping the two apart is what lets the protocol loop stay ignorant of
migration stages (go-control-plane's SnapshotCache, in one small class).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from migration.xds.snapshot import Snapshot

ANY_NODE = "*"

Watcher = Callable[[str], None]
"""Called with the node id whose snapshot changed ("*" when the default changed)."""


class SnapshotCache:
    """Thread-safe map node id -> Snapshot; `"*"` is the default for nodes without their own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._snapshots: dict[str, Snapshot] = {}
        self._watchers: dict[int, Watcher] = {}
        self._next_watch = 0

    def set_snapshot(self, node_id: str, snapshot: Snapshot) -> None:
        """Publish `snapshot` for `node_id` (or every node with "*") after checking it.

        An inconsistent snapshot raises ConfigError and the previous one stays served.
        """
        snapshot.check()
        with self._lock:
            self._snapshots[node_id] = snapshot
            watchers = list(self._watchers.values())
        for watcher in watchers:
            watcher(node_id)

    def clear(self, node_id: str) -> None:
        """Forget a node's own snapshot; it falls back to the default."""
        with self._lock:
            removed = self._snapshots.pop(node_id, None)
            watchers = list(self._watchers.values())
        if removed is not None:
            for watcher in watchers:
                watcher(node_id)

    def get(self, node_id: str, default: bool = True) -> Snapshot | None:
        """The node's own snapshot, else (unless `default` is False) the default, else None."""
        with self._lock:
            own = self._snapshots.get(node_id)
            return own if own is not None or not default else self._snapshots.get(ANY_NODE)

    def nodes(self) -> list[str]:
        with self._lock:
            return sorted(self._snapshots)

    def watch(self, watcher: Watcher) -> Callable[[], None]:
        """Register `watcher`; returns the function that unregisters it."""
        with self._lock:
            key = self._next_watch
            self._next_watch += 1
            self._watchers[key] = watcher

        def cancel() -> None:
            with self._lock:
                self._watchers.pop(key, None)

        return cancel
