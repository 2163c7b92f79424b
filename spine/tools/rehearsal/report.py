"""What a rehearsal saw (`python -m spine.tools.rehearsal.run`): each run's stages as published and
ACKed, every window's gate verdicts, what the proxyless clients got; and how it is printed."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from migration.status import AuditEntry, GateRecord
from services.registry import MIDDLEWARES
from spine.tools.rehearsal.store import StoreLook
from wire.v1 import migration_pb2

SPINES = ("spine-a", "spine-b")  # the rehearsal's spine replicas (node ids)


@dataclass
class StageRecord:
    """One version the controller published during a run, as the rehearsal saw it."""

    name: str
    version: str
    spine_weight: float
    placements: dict[str, str]  # as the controller applied them
    applied_after_s: float | None = None  # from publication to every ACK (None: never applied)
    followers: list[dict[str, Any]] = field(default_factory=list)  # rows when it counted as applied
    data_planes: dict[str, str] = field(default_factory=dict)  # node -> the version it ACKed, all types
    gates: list[list[dict[str, Any]]] = field(default_factory=list)  # per window
    answers: Counter[str] = field(default_factory=Counter)  # layout that answered -> count, during it

    @classmethod
    def published(cls, status: migration_pb2.RolloutStatus) -> StageRecord:
        """The version in `status`, just seen published (a stage, or a rollback of one)."""
        rollback = status.state in ("rolling_back", "rolled_back")
        name = f"rollback of {status.stage_name}" if rollback else status.stage_name
        return cls(name, status.version, status.spine_weight, dict(status.placements))

    def published_lines(self, status: migration_pb2.RolloutStatus) -> list[str]:
        rollback = self.name.startswith("rollback of ")
        where = (f"ROLLBACK of stage {status.stage_name}" if rollback else
                 f"stage {status.stage_index + 1}/{status.stage_count} {status.stage_name}")
        lines = [f"  {where}: published {status.version}: spine {status.spine_weight:g}% / layered "
                 f"{status.layered_weight:g}%, spine placements local: {local_names(status.placements)}"]
        reason = rollback_reason(status)
        if rollback and reason:
            lines.append(f"    why: {reason}")
        return lines

    def note_applied(self, status: migration_pb2.RolloutStatus, after_s: float) -> None:
        """Every follower and data plane ACKed it, `after_s` after it was published."""
        self.applied_after_s = after_s
        self.followers = [follower_row(f) for f in status.followers]
        self.data_planes = data_planes(status)

    def applied_lines(self) -> list[str]:
        lines = [f"    ACKed by every follower and data plane in {self.applied_after_s or 0:.1f}s:"]
        for row in self.followers:
            local = f"  local: {local_names(row['placements'])}" if row["role"] == "spine" else ""
            lines.append(f"      {row['node_id']:<20} {row['role']:<17} applied {row['acked_version']:<16} "
                         f"share {row['ratelimit_share']:.3f}{local}")
        lines.append("      data planes: " + ", ".join(f"{node} {version}" for node, version in self.data_planes.items()))
        return lines


@dataclass
class RunRecord:
    title: str
    final_state: str = ""
    seconds: float = 0.0
    stages: list[StageRecord] = field(default_factory=list)
    codes: Counter[str] = field(default_factory=Counter)  # what the proxyless clients got during the run
    layouts: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    failed_gates: list[str] = field(default_factory=list)
    rollback_reason: str = ""

    def outcome(self) -> str:
        return (f"rolled back by the {' and '.join(self.failed_gates)} gate" if self.failed_gates
                else self.final_state.replace("_", " "))


@dataclass
class Report:
    runs: dict[str, RunRecord] = field(default_factory=dict)
    gate_history: list[GateRecord] = field(default_factory=list)
    audit: list[AuditEntry] = field(default_factory=list)
    stopped: list[tuple[str, int, int | None]] = field(default_factory=list)  # (name, pid, exit code)
    seconds: float = 0.0
    store: list[StoreLook] = field(default_factory=list)  # the shared lease store, at each look
    # Where the controller kept its state: "sqlite", or PostgreSQL with the lease as it ended.
    controller_store: str = ""

    def ok(self) -> bool:
        healthy = self.runs.get("healthy")
        parity = self.runs.get("parity")
        good = healthy is not None and healthy.final_state == "promoted" and set(healthy.codes) == {"OK"}
        # every rate limiter reached the shared store and leased from it
        good = good and bool(self.store) and all(not limiter.error and limiter.calls_ok > 0
                                                 for limiter in self.store[-1].limiters)
        if parity is not None:
            good = good and parity.final_state == "rolled_back" and parity.failed_gates == ["parity"]
        return good


def local_names(placements: Mapping[str, str]) -> str:
    local = [name for name in MIDDLEWARES if placements.get(name) == "local"]
    return ", ".join(local) if local else "none (its own config's until a stage says)" if not placements else "none"


def counts_text(counter: Mapping[str, int]) -> str:
    return ", ".join(f"{key} {value}" for key, value in sorted(counter.items())) or "nothing"


def follower_row(row: migration_pb2.Follower) -> dict[str, Any]:
    return {"node_id": row.node_id, "role": row.role, "acked_version": row.acked_version,
            "ratelimit_share": row.ratelimit_share, "placements": dict(row.placements),
            "nack_error": row.nack_error}


def data_planes(status: migration_pb2.RolloutStatus) -> dict[str, str]:
    """Node -> the version it ACKed for every type it reads ("mixed" while its types disagree)."""
    versions: dict[str, set[str]] = {}
    for plane in status.data_planes:
        versions.setdefault(plane.node_id, set()).add(plane.acked_version)
    return {node: next(iter(v)) if len(v) == 1 else "mixed" for node, v in sorted(versions.items())}


def new_windows(status: migration_pb2.RolloutStatus, seen: set[tuple[str, float]]) -> Iterator[list[dict[str, Any]]]:
    """The gate results of each window not printed yet (`last_gates` holds the latest window's)."""
    windows: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for gate in status.last_gates:
        key = (gate.stage, gate.window_end)
        if key not in seen:
            windows.setdefault(key, []).append({"stage": gate.stage, "gate": gate.gate, "verdict": gate.verdict,
                                                "message": gate.message, "dry_run": gate.dry_run,
                                                "window_end": gate.window_end})
    for key, window in sorted(windows.items(), key=lambda item: item[0][1]):
        seen.add(key)
        yield window


def rollback_reason(status: migration_pb2.RolloutStatus) -> str:
    """Why the controller rolled back, as its audit says ("" when it did not)."""
    return next((a.reason for a in reversed(status.recent_audit) if a.action == "rollback"), "")


def gate_text(gate: Mapping[str, Any]) -> str:
    return f"{gate['gate']} {gate['verdict'].upper()}{' (dry run)' if gate['dry_run'] else ''}: {gate['message']}"


def summary(report: Report) -> str:
    lines = []
    healthy, parity = report.runs.get("healthy"), report.runs.get("parity")
    if healthy is not None:
        acked = all(all(r["acked_version"].startswith(s.version) for r in s.followers if r["role"] == "spine")
                    and sum(r["role"] == "spine" for r in s.followers) == len(SPINES)
                    for s in healthy.stages if s.applied_after_s is not None)
        lines.append(f"healthy spine → {healthy.final_state.replace('_', ' ')} in {healthy.seconds:.1f}s, "
                     f"{len(healthy.stages)} stages, " + ("each ACKed by both spine replicas" if acked else
                                                          "NOT every stage ACKed by both spine replicas")
                     + f"; the proxyless clients got {counts_text(healthy.codes)} (answered by {counts_text(healthy.layouts)})")
    if parity is not None:
        lines.append(f"spine answering differently → {parity.outcome()} in {parity.seconds:.1f}s: {parity.rollback_reason}")
    if report.store:
        lines.extend(report.store[-1].lines())
    if report.controller_store:
        lines.append(f"controller state: {report.controller_store}")
    lines.append(f"stopped {len(report.stopped)} processes by PID: "
                 + ", ".join(f"{name} {pid}" for name, pid, _ in report.stopped))
    return "\n".join(["summary:", *(f"  {line}" for line in lines)])
