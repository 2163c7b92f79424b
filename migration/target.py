"""The controller's only view of the data path: apply a stage, read a window, check ACKs.

The controller decides; the data path (the built-in front, the spine, an xDS control
plane) carries out. Keeping the contract this small lets the controller be tested against
a recording double and lets the lead wire in the real front without touching it.
"""

from __future__ import annotations

from typing import Protocol

from migration.gates import WindowStats


class TrafficTarget(Protocol):
    def apply(self, spine_weight: float, placements: dict[str, str], version: str) -> None:
        """Send `spine_weight`% of traffic to the spine, with the spine's middlewares placed so.

        Must return quickly (a rollback is applied within a second); data planes catch up
        asynchronously and report through `applied`.
        """
        ...

    def window_stats(self, since: float) -> tuple[WindowStats, WindowStats, int]:
        """Layered stats, spine stats and parity mismatches for requests since `since`."""
        ...

    def applied(self, version: str) -> bool:
        """True once every data plane has ACKed `version` (xDS); the front is immediate."""
        ...
