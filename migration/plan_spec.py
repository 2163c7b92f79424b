"""What a migration plan says, as data: its stages, each stage's gates, and their defaults.

A plan is data (like an Argo Rollouts strategy): the controller only compares the plan with
the recorded status and does the next action, so these records are all it reads. They are
apart from the reading of a plan's YAML (`migration.plan`, strict, every problem at once),
which is the larger part and the only one that changes when the plan's format does.
"""

from __future__ import annotations

from dataclasses import dataclass

from migration.judge_spec import JudgeSpec
from migration.legacy_endpoint import LegacyEndpoint
from services.common import ConfigError

PLACEMENTS: tuple[str, ...] = ("local", "remote")
# Each gate type and the one threshold field it takes.
GATE_THRESHOLDS: dict[str, str] = {
    "error_rate": "max_delta",
    "latency_p99_ratio": "max_ratio",
    "parity": "max_mismatches",
}
# Optional fields a gate may carry beside its threshold (every gate may set min_requests).
GATE_OPTIONS: dict[str, tuple[str, ...]] = {
    "error_rate": ("min_requests",),
    "latency_p99_ratio": ("min_requests", "min_delta_ms"),
    "parity": ("min_requests",),
}

DEFAULT_WINDOW_S = 10.0
DEFAULT_MIN_WINDOW_REQUESTS = 20
# A latency ratio fails only when the p99s are also this many ms apart: 0.25 ms against
# 0.1 ms is a ratio of 2.5 and means nothing.
DEFAULT_MIN_DELTA_MS = 5.0
# `x-spine-route: layered|spine` forces a side while the plan runs: an operator's tool, on by
# default (the local demo plans use it); a plan for clients that are not trusted turns it off.
DEFAULT_ROUTE_HEADER = True


class PlanError(ConfigError):
    """One or more plan problems; each names the field path and the YAML line."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class GateSpec:
    """One analysis gate of a stage; a dry-run gate is evaluated and recorded, never obeyed.

    `min_requests`: requests per side a window needs before this gate judges (None: the
    plan's min_window_requests; for the latency gate, successful requests). `min_delta_ms`:
    the latency gate's floor, ignored by the others.
    """

    type: str
    threshold: float
    dry_run: bool = False
    min_requests: int | None = None
    min_delta_ms: float = DEFAULT_MIN_DELTA_MS

    def describe(self) -> str:
        text = f"{self.type} {GATE_THRESHOLDS[self.type]}={self.threshold:g}"
        if self.type == "latency_p99_ratio":
            text += f" min_delta_ms={self.min_delta_ms:g}"
        if self.min_requests is not None:
            text += f" min_requests={self.min_requests}"
        return text + " (dry run)" if self.dry_run else text


@dataclass(frozen=True)
class Stage:
    name: str
    spine_weight: float
    placements: dict[str, str]
    hold_s: float | None
    min_requests: int | None
    gates: tuple[GateSpec, ...]
    failure_limit: int
    # An operator must approve before the controller ENTERS this stage.
    manual_approval: bool
    # How its windows are judged beside the gates (`migration.judge`); None: the gates alone.
    judge: JudgeSpec | None = None


@dataclass(frozen=True)
class Plan:
    name: str
    stages: tuple[Stage, ...]
    window_s: float
    min_window_requests: int
    source: str  # the YAML text as given: persisted, so a restart re-reads the same plan
    description: str = ""
    # Whether the data path honours `x-spine-route` (forcing a side) while this plan runs.
    route_header: bool = DEFAULT_ROUTE_HEADER
    # The "from" side when it is a foreign HTTP endpoint (`migration.legacy_endpoint`); None:
    # spine's layered stack.
    legacy: LegacyEndpoint | None = None

    def stage_index(self, name: str) -> int | None:
        for index, stage in enumerate(self.stages):
            if stage.name == name:
                return index
        return None

    def parity_gates(self) -> list[str]:
        """The field path of every parity gate (dry run or not), e.g. `stages[1].gates[2]`."""
        gates = [f"stages[{i}].gates[{j}]" for i, stage in enumerate(self.stages)
                 for j, gate in enumerate(stage.gates) if gate.type == "parity"]
        judged = [path for stage in self.stages if stage.judge for path in stage.judge.parity_paths()]
        return gates + [path for i, path in enumerate(judged) if path not in judged[:i]]
