"""A TrafficTarget that records what it was told and reports the stats it is given.

It stands in for the data path in controller tests and in `python -m migration.runner
--target recording`. With a `path`, every apply is appended to a JSON file, so a test
can read what a (killed and restarted) controller process applied.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from migration.gates import ParityStats, WindowStats
from migration.target import ShadowCapability

HEALTHY = WindowStats(requests=1000, errors=0, p99_ms=10.0)
AGREEING = ParityStats(compared=100, mismatches=0)


@dataclass(frozen=True)
class Applied:
    spine_weight: float
    placements: dict[str, str]
    version: str
    route_header: bool = True  # what the plan said about `x-spine-route` (absent in older files)


class RecordingTarget:
    """Records applies; window stats and ACKs are whatever the test sets."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *,
                 layered: WindowStats = HEALTHY, spine: WindowStats = HEALTHY,
                 parity: ParityStats = AGREEING, shadow_enabled: bool = True, auto_ack: bool = True) -> None:
        self.path = Path(path) if path is not None else None
        self.layered = layered
        self.spine = spine
        self.parity = parity
        self.shadow_enabled = shadow_enabled
        self.auto_ack = auto_ack
        self.applies: list[Applied] = []
        self.stats_calls: list[float] = []
        self._acked: set[str] = set()
        self._lock = threading.Lock()

    def apply(self, spine_weight: float, placements: dict[str, str], version: str, *,
              route_header: bool) -> None:
        with self._lock:
            self.applies.append(Applied(spine_weight, dict(placements), version, route_header))
            if self.path is not None:
                self._append(self.path, self.applies[-1])

    def window_stats(self, since: float) -> tuple[WindowStats, WindowStats, ParityStats]:
        with self._lock:
            self.stats_calls.append(since)
            return self.layered, self.spine, self.parity

    def layout_stats(self, since: float) -> tuple[WindowStats, WindowStats]:
        """The stats it is given, without recording a call (the dashboard's reading)."""
        with self._lock:
            return self.layered, self.spine

    def shadow(self) -> ShadowCapability:
        if self.shadow_enabled:
            return ShadowCapability(True, "a recording target reports the parity it is given")
        return ShadowCapability(False, "this recording target was told shadow is off")

    def applied(self, version: str) -> bool:
        with self._lock:
            return self.auto_ack or version in self._acked

    def ack(self, version: str) -> None:
        """Play a data plane ACKing `version` (when auto_ack is off)."""
        with self._lock:
            self._acked.add(version)

    @property
    def last(self) -> Applied:
        return self.applies[-1]

    @staticmethod
    def _append(path: Path, applied: Applied) -> None:
        # One JSON object per line, flushed and fsynced: the file must survive a SIGKILL.
        with path.open("a", encoding="utf-8") as out:
            out.write(json.dumps(asdict(applied)) + "\n")
            out.flush()
            os.fsync(out.fileno())

    @staticmethod
    def read_applies(path: str | os.PathLike[str]) -> list[Applied]:
        """The applies a RecordingTarget with this `path` wrote, oldest first."""
        lines = Path(path).read_text(encoding="utf-8").splitlines() if Path(path).exists() else []
        return [Applied(**json.loads(line)) for line in lines if line.strip()]
