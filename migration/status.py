"""The rollout's recorded status: everything a person (or a restarted controller) needs.

Like an Argo Rollout's status block, one record says where the migration stands; the
audit rows say how it got there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from services.registry import MIDDLEWARES


class State(StrEnum):
    PENDING = "pending"
    PROGRESSING = "progressing"
    PAUSED = "paused"
    AWAITING_APPROVAL = "awaiting_approval"
    PROMOTED = "promoted"
    ROLLING_BACK = "rolling_back"
    ROLLED_BACK = "rolled_back"
    ABORTED = "aborted"


# States from which `start` may begin a new rollout (a convenience for readers of the status;
# the controller itself asks migration/transitions.py, and a test keeps the two in step).
FINISHED = frozenset({State.PENDING, State.PROMOTED, State.ROLLED_BACK, State.ABORTED})


def all_remote() -> dict[str, str]:
    return dict.fromkeys(MIDDLEWARES, "remote")


@dataclass
class RolloutStatus:
    """The single status row. Times are wall-clock seconds so they survive a restart."""

    plan_name: str = ""
    plan_yaml: str = ""
    state: State = State.PENDING
    stage_index: int = 0
    spine_weight: float = 0.0
    placements: dict[str, str] = field(default_factory=all_remote)
    consecutive_failures: int = 0
    generation: int = 0  # bumped on every apply; the version data planes ACK
    version: str = ""
    acked: bool = False  # the target reported `applied(version)`
    stage_started_at: float | None = None  # set at the stage's first ACK; the hold counts from it
    window_started_at: float | None = None
    stage_requests: int = 0  # spine requests seen in this stage's evaluated windows
    last_verdict: str = ""  # verdict of this stage's latest window ("" before the first)
    paused_at: float | None = None
    resume_state: str = ""  # the state `resume` returns to from paused
    updated_at: float = 0.0

    @property
    def layered_weight(self) -> float:
        return 100.0 - self.spine_weight


@dataclass(frozen=True)
class AuditEntry:
    id: int
    ts: float
    actor: str
    action: str
    from_state: str
    to_state: str
    stage: str
    reason: str


@dataclass(frozen=True)
class GateRecord:
    """One gate's result in one window, as kept in the history."""

    id: int
    ts: float
    stage: str
    version: str
    window_start: float
    window_end: float
    gate: str
    verdict: str
    value: float | None
    threshold: float
    dry_run: bool
    message: str


@dataclass(frozen=True)
class TransitionEvent:
    """One transition as it was committed (status and audit row): what a notification says.

    `gates` are the stage's latest window's results at that moment (empty before any window
    was judged), so a receiver sees why a rollback happened without asking the controller."""

    audit_id: int
    ts: float
    plan: str
    stage: str
    action: str
    actor: str
    from_state: str
    to_state: str
    reason: str
    spine_weight: float
    version: str
    gates: tuple[GateRecord, ...] = ()
