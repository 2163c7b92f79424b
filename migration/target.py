"""The controller's only view of the data path: apply a stage, read a window, check ACKs.

The controller decides; the data path (the built-in front, the spine, an xDS control
plane) carries out. Keeping the contract this small lets the controller be tested against
a recording double and lets the real front, the spine and xDS be wired in without touching it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from migration.gates import ParityStats, WindowStats
from migration.legacy_endpoint import LegacyEndpoint


@dataclass(frozen=True)
class ShadowCapability:
    """Whether shadow comparisons reach the parity gate on this data path, and how one knows.

    `detail` says what was checked when `enabled`, else why not and what turns it on: the
    controller refuses a plan with a parity gate when shadow is off, with this reason.
    """

    enabled: bool
    detail: str


class TrafficTarget(Protocol):
    def apply(self, spine_weight: float, placements: dict[str, str], version: str, *,
              route_header: bool) -> None:
        """Send `spine_weight`% of traffic to the spine, with the spine's middlewares placed so.

        `route_header`: whether `x-spine-route: layered|spine` forces a side from now on (the
        running plan's `route_header`); the controller passes it with every apply, a stage, a
        rollback, an abort or the re-apply after a restart alike.

        Must return quickly (a rollback is applied within a second); data planes catch up
        asynchronously and report through `applied`.
        """
        ...

    def window_stats(self, since: float) -> tuple[WindowStats, WindowStats, ParityStats]:
        """Layered stats, spine stats and the shadow comparisons for requests since `since`."""
        ...

    def applied(self, version: str) -> bool:
        """True once every data plane has ACKed `version` (xDS); the front is immediate."""
        ...

    def shadow(self) -> ShadowCapability:
        """Whether anything mirrors traffic and exports its comparisons where the gates read
        them: without it a parity gate could never judge, so a plan with one is refused."""
        ...


def legacy_of(target: object) -> LegacyEndpoint | None:
    """The foreign legacy endpoint a target splits traffic with (its optional `legacy()`), or
    None where the from side is spine's layered stack (every target without that method)."""
    legacy = getattr(target, "legacy", None)
    return legacy() if callable(legacy) else None
