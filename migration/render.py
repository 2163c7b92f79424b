"""How a rollout looks in a terminal: the status tables and the `run` progress bars.

Kept apart from the CLI's argument handling so that what an operator reads can be changed
(and tested) without touching how commands reach the controller.
"""

from __future__ import annotations

import time
from typing import Any

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from rich.console import Console, Group
from rich.progress import BarColumn, Progress, TaskID, TextColumn
from rich.table import Table

from migration.legacy_endpoint import LAYERED_SIDE
from services.registry import MIDDLEWARES
from wire.v1 import migration_pb2 as pb

_STATE_STYLE = {
    "progressing": "cyan", "paused": "yellow", "awaiting_approval": "magenta", "promoted": "green",
    "rolling_back": "red", "rolled_back": "red", "aborted": "bold red", "pending": "dim",
}
_VERDICT_STYLE = {"pass": "green", "fail": "red", "inconclusive": "yellow"}


def to_json(message: Message) -> dict[str, Any]:
    return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def stage_label(status: pb.RolloutStatus) -> str:
    if not status.stage_count:
        return "-"
    return f"{status.stage_index + 1}/{status.stage_count} {status.stage_name}"


def from_side(status: pb.RolloutStatus | pb.PlanResponse) -> str:
    """What the rollout moves traffic away from: a foreign gateway's name, or layered."""
    return status.from_side or LAYERED_SIDE


def leader_label(lead: pb.Leadership) -> str:
    """Who leads, at which epoch, and whether the replica asked is that one."""
    if not lead.leader:
        return f"none right now (an election is under way); asked {lead.controller}"
    where = f" at {lead.leader_address}" if lead.leader_address else ""
    asked = "this replica" if lead.leading else f"asked {lead.controller}, which follows"
    fenced = f"; {lead.fenced_writes} write(s) refused by the fence here" if lead.fenced_writes else ""
    return f"{lead.leader}{where}, epoch {lead.epoch} ({asked}){fenced}"


def status_renderable(status: pb.RolloutStatus, dashboard_link: str = "") -> Group:
    """State, stage, weights, placements, last gate results and recent audit rows.

    `dashboard_link`: the dashboard's URL with the admin token in its fragment, for a client
    that holds the token (`migration.admin_token.dashboard_link`); else the status's own URL."""
    style = _STATE_STYLE.get(status.state, "")
    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="bold")
    summary.add_column()
    summary.add_row("plan", status.plan_name or "(none loaded)")
    summary.add_row("state", f"[{style}]{status.state}[/]" if style else status.state)
    summary.add_row("stage", stage_label(status))
    if status.awaiting_stage:
        summary.add_row("awaiting", f"approval to enter {status.awaiting_stage!r} (spine migrate approve)")
    summary.add_row("from", _from_words(status))
    summary.add_row("weights", f"spine {status.spine_weight:g}%  {from_side(status)} {status.layered_weight:g}%")
    hold = f"{status.stage_elapsed_s:.0f}s" + (f" / {status.hold_s:g}s" if status.HasField("hold_s") else "")
    summary.add_row("hold", hold)
    requests = f"{status.stage_requests}" + (f" / {status.min_requests}" if status.HasField("min_requests") else "")
    summary.add_row("spine requests", requests)
    summary.add_row("failing windows", f"{status.consecutive_failures} (limit {status.failure_limit})")
    summary.add_row("version", f"{status.version or '-'} ({'applied' if status.applied else 'waiting for ACK'})")
    if dashboard_link or status.dashboard_url:
        summary.add_row("dashboard", dashboard_link or status.dashboard_url)
    if status.HasField("leadership"):
        summary.add_row("leader", leader_label(status.leadership))

    parts: list[Any] = [summary]
    if from_side(status) == LAYERED_SIDE:  # a foreign gateway has no middlewares to move
        placements = Table(title="placements", title_justify="left")
        for middleware in MIDDLEWARES:
            placements.add_column(middleware)
        placements.add_row(*[_placement(status.placements.get(m, "?")) for m in MIDDLEWARES])
        parts.append(placements)
    if status.last_gates:
        gates = Table(title=f"last window's gates (stage {status.last_gates[0].stage})", title_justify="left")
        for column in ("gate", "verdict", "value", "threshold", "message"):
            gates.add_column(column)
        for gate in status.last_gates:
            verdict = f"[{_VERDICT_STYLE.get(gate.verdict, '')}]{gate.verdict}[/]"
            if gate.dry_run:
                verdict += " (dry run)"
            value = f"{gate.value:.4g}" if gate.HasField("value") else "-"
            gates.add_row(gate.gate, verdict, value, f"{gate.threshold:g}", gate.message)
        parts.append(gates)
    if status.data_planes or status.min_data_planes:
        acked = len({p.node_id for p in status.data_planes if p.acked_version == status.version})
        planes = Table(title=f"xDS data planes: {acked} ACKed {status.version or '-'}; a stage is applied "
                             f"once at least {status.min_data_planes} have", title_justify="left")
        for column in ("node", "type", "acked", "sent", "NACK"):
            planes.add_column(column)
        for plane in status.data_planes:
            nack = f"[red]{plane.nacked_version}: {plane.nack_error}[/]" if plane.nack_error else "-"
            planes.add_row(plane.node_id, plane.type, plane.acked_version or "-", plane.sent_version or "-", nack)
        parts.append(planes)
    if status.followers or status.min_spine_replicas:
        parts.append(followers_table(status))
    if status.recent_audit:
        parts.append(audit_table(status.recent_audit))
    return Group(*parts)


def followers_table(status: pb.RolloutStatus) -> Table:
    """Spine replicas and layered rate limiters following the stage: what each was assigned
    and whether it applied it ("+mN" versions: the stage republished as followers came and went)."""
    version = status.version or "-"
    current = [f for f in status.followers
               if f.acked_version == version or f.acked_version.startswith(f"{version}+m")]
    spines = sum(1 for f in status.followers if f.role == "spine")
    table = Table(title=f"stage followers: {len(current)} of {len(status.followers)} applied {version} "
                        f"(spine replicas: {spines}; a stage is applied once all have, with at least "
                        f"{status.min_spine_replicas} spine replicas)", title_justify="left")
    for column in ("node", "role", "assigned share", "assigned local", "acked", "sent", "NACK"):
        table.add_column(column)
    for follower in status.followers:
        nack = f"[red]{follower.nacked_version}: {follower.nack_error}[/]" if follower.nack_error else "-"
        share = (f"{follower.ratelimit_share:.4g} (1/{follower.replicas} of its side)"
                 if follower.ratelimit_share else "-")
        local = ", ".join(m for m in MIDDLEWARES if follower.placements.get(m) == "local")
        placed = (local or "none") if follower.placements else "-"
        table.add_row(follower.node_id, follower.role, share, placed, follower.acked_version or "-",
                      follower.sent_version or "-", nack)
    return table


def audit_table(rows: Any) -> Table:
    table = Table(title="recent audit", title_justify="left")
    for column in ("time", "actor", "action", "from → to", "stage", "reason"):
        table.add_column(column)
    for row in rows:
        table.add_row(_clock(row.ts), row.actor, row.action, f"{row.from_state} → {row.to_state}", row.stage,
                      row.reason)
    return table


def audit_line(row: pb.AuditEvent) -> str:
    return (f"{_clock(row.ts)}  {row.action:<14} {row.from_state} → {row.to_state}  "
            f"[bold]{row.stage}[/]  {row.reason}  [dim]({row.actor})[/]")


def plan_table(plan: pb.PlanResponse) -> Table:
    foreign = from_side(plan) != LAYERED_SIDE
    table = Table(title=f"plan {plan.name}: from {from_side(plan)} to the spine, window {plan.window_s:g}s, "
                        f"min {plan.min_window_requests} requests per side", title_justify="left")
    for column in ("#", "stage", "spine %", "spine serves" if foreign else "local (rest remote)", "hold",
                   "min req", "gates", "approval"):
        table.add_column(column)
    for index, stage in enumerate(plan.stages, start=1):
        local = [m for m in MIDDLEWARES if stage.placements.get(m) == "local"]
        table.add_row(
            str(index), stage.name, f"{stage.spine_weight:g}", "whole" if foreign else ", ".join(local) or "-",
            f"{stage.hold_s:g}s" if stage.HasField("hold_s") else "-",
            str(stage.min_requests) if stage.HasField("min_requests") else "-",
            "\n".join(stage.gates) or "-", "manual" if stage.manual_approval else "",
        )
    return table


class RunProgress:
    """Two bars for `spine migrate run`: stages done, and the current stage's hold."""

    def __init__(self, console: Console) -> None:
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                 TextColumn("{task.fields[detail]}"), console=console)
        self._stages: TaskID | None = None
        self._hold: TaskID | None = None

    def __enter__(self) -> RunProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(None, None, None)

    def update(self, status: pb.RolloutStatus) -> None:
        done = status.stage_index + (1 if status.state == "promoted" else 0)
        detail = f"{stage_label(status)}  spine {status.spine_weight:g}%  [{status.state}]"
        hold_total = status.hold_s if status.HasField("hold_s") and status.hold_s > 0 else 1.0
        hold_done = min(status.stage_elapsed_s, hold_total) if status.HasField("hold_s") else 0.0
        hold_detail = (f"{status.stage_elapsed_s:.0f}s / {status.hold_s:g}s" if status.HasField("hold_s")
                       else "no hold") + f"  verdict {status.last_verdict or '-'}"
        if self._stages is None:
            self._stages = self.progress.add_task("stages", total=max(status.stage_count, 1), detail=detail)
            self._hold = self.progress.add_task("hold  ", total=hold_total, detail=hold_detail)
        self.progress.update(self._stages, completed=done, total=max(status.stage_count, 1), detail=detail)
        assert self._hold is not None
        self.progress.update(self._hold, completed=hold_done, total=hold_total, detail=hold_detail)

    def print(self, text: str) -> None:
        self.progress.console.print(text)


def _placement(value: str) -> str:
    return "[green]local[/]" if value == "local" else value


def _from_words(status: pb.RolloutStatus) -> str:
    if from_side(status) == LAYERED_SIDE:
        return "layered (spine's own stack: middlewares move into the spine stage by stage)"
    return f"{from_side(status)} (a foreign gateway: the spine serves whole, only traffic moves)"


def _clock(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts)) if ts else "-"
