"""The rollouts a controller has run, one row each, read back from its audit trail.

The status row says where the current rollout stands; a person who comes to the dashboard
after a few of them (the demo walks its plan three times: promoted, rolled back twice) wants
each one's outcome too. Every rollout begins with a `start` row, whose reason names it, and
ends in a finished state (promoted, rolled back, aborted) whose cause is the reason of the
`promote`, `rollback` or `abort` row that led there; a `resume` after a rollback retries the
same rollout. All of it is in the audit trail already, so the runs need no table of their own
and survive a controller restart like the rest.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from migration.status import FINISHED, AuditEntry, State

RUN_ACTIONS = ("start", "promote", "rollback", "abort", "rolled_back", "resume")
_CAUSES = ("promote", "rollback", "abort")
RUNS_SHOWN = 20


@dataclass
class Run:
    started_at: float
    title: str          # the start's reason (the demo: "healthy spine"; else who started which plan)
    actor: str
    state: str          # where it stands or ended
    stage: str          # the stage it stands at or ended in
    why: str = ""       # the reason of what finished it (a rollback's failing gates)
    ended_at: float | None = None


def runs_from_audit(rows: list[AuditEntry], shown: int = RUNS_SHOWN) -> list[dict[str, Any]]:
    """The last `shown` rollouts in `rows` (audit rows, oldest first), oldest first."""
    runs: list[Run] = []
    for row in rows:
        if row.action == "start":
            runs.append(Run(row.ts, row.reason, row.actor, row.to_state, row.stage))
            continue
        if not runs or row.action not in RUN_ACTIONS:
            continue
        run = runs[-1]
        run.state, run.stage = row.to_state, row.stage
        if row.action in _CAUSES:
            run.why = row.reason
        run.ended_at = row.ts if State(row.to_state) in FINISHED else None
    return [asdict(run) for run in runs[-shown:]]
