"""What the dashboard shows, as one JSON document: the status, the plan, gate history, layouts.

The status and the plan are the very messages `spine migrate status --json` and `spine migrate
plan --json` print (`migration.service.status_message`, `plan_message`), so the page, the
CLI and a script read one vocabulary. Beside them: every gate's value against its threshold
window by window (the chart), the audit trail, each rollout's outcome (`runs`, read back from
the audit trail: the demo's three runs stay on the page after the last), and each side's
latency, error rate and throughput over the last `LAYOUT_WINDOW_S`, read from the controller's own metric source
(the target's `layout_stats`: the front in the local migration, PromQL or a direct scrape
of each side against real data planes).
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Any

from migration.controller import Controller
from migration.dashboard.runs import RUN_ACTIONS, RUNS_SHOWN, runs_from_audit
from migration.gates import WindowStats
from migration.judge.score import METRIC_ROW
from migration.render import to_json
from migration.service import plan_message, status_message
from migration.status import GateRecord

LAYOUT_WINDOW_S = 10.0  # the layouts' numbers: requests that ended in the last 10 s
SAMPLE_EVERY_S = 1.0  # the metric source is read at most once a second, however many pages watch
HISTORY = 300  # layout samples kept for the charts (5 minutes at one a second)
GATE_ROWS = 400
AUDIT_ROWS = 50


@dataclass(frozen=True)
class LayoutSample:
    ts: float
    sides: dict[str, dict[str, Any]]


def side_numbers(stats: WindowStats, window_s: float) -> dict[str, Any]:
    """One side's numbers as the page shows them (None where the source has none)."""
    return {"requests": stats.requests, "errors": stats.errors,
            "error_rate": stats.error_rate if stats.requests else None,
            "rps": stats.requests / window_s, "p50_ms": stats.p50_ms or None, "p99_ms": stats.p99_ms or None,
            "missing": stats.missing}


class LayoutSampler:
    """Each side's numbers, read from the target at most every `SAMPLE_EVERY_S`, with history."""

    def __init__(self, target: Any, clock: Any = time.time) -> None:
        self._target = target
        self._clock = clock
        self._lock = threading.Lock()
        self.samples: collections.deque[LayoutSample] = collections.deque(maxlen=HISTORY)

    def latest(self) -> LayoutSample:
        now = self._clock()
        with self._lock:
            if self.samples and now - self.samples[-1].ts < SAMPLE_EVERY_S:
                return self.samples[-1]
            try:
                layered, spine = self._read(now - LAYOUT_WINDOW_S)
            except Exception as error:  # a metric source that cannot be read now: say so, try again
                missing = WindowStats(0, 0, None, 0, missing=f"{type(error).__name__}: {error}")
                layered = spine = missing
            sample = LayoutSample(now, {"layered": side_numbers(layered, LAYOUT_WINDOW_S),
                                        "spine": side_numbers(spine, LAYOUT_WINDOW_S)})
            self.samples.append(sample)
            return sample

    def _read(self, since: float) -> tuple[WindowStats, WindowStats]:
        """Each side's stats: the target's `layout_stats` where it has one (no parity read),
        else the gates' own reading."""
        layout_stats = getattr(self._target, "layout_stats", None)
        if layout_stats is not None:
            return layout_stats(since)  # type: ignore[no-any-return]
        layered, spine, _ = self._target.window_stats(since)
        return layered, spine


def gate_point(record: GateRecord) -> dict[str, Any]:
    return {"id": record.id, "stage": record.stage, "gate": record.gate, "verdict": record.verdict,
            "value": record.value, "threshold": record.threshold, "dry_run": record.dry_run,
            "window_start": record.window_start, "window_end": record.window_end, "message": record.message}


def judge_points(history: list[GateRecord]) -> list[dict[str, Any]]:
    """The judge's latest window: its score row, then each metric's (verdict, effect, margin and
    the message with its interval); empty where no stage has a judge."""
    judged = [r for r in history if r.gate == "judge"]
    if not judged:
        return []
    last = judged[-1]
    return [gate_point(r) for r in history if r.window_end == last.window_end and r.stage == last.stage
            and (r.gate == "judge" or r.gate.startswith(METRIC_ROW))]


def snapshot(controller: Controller, sampler: LayoutSampler, *, view_without_token: bool) -> dict[str, Any]:
    """The whole page's data. `revision` changes whenever the status or an audit row does."""
    view = controller.view(audit_rows=AUDIT_ROWS)
    latest = sampler.latest()
    history = list(sampler.samples)
    status = to_json(status_message(view))
    gates = controller.store.gate_history(GATE_ROWS)
    last_audit = view.recent_audit[-1].id if view.recent_audit else 0
    return {
        "revision": f"{last_audit}:{view.status.updated_at}:{view.status.acked}",
        "now": time.time(),
        "status": status,
        "plan": to_json(plan_message(view.plan, loaded=True)) if view.plan else None,
        "gate_history": [gate_point(r) for r in gates],
        "judge": judge_points(gates),
        # Each rollout's outcome, from its audit rows (a run's rows are a handful; 40 a run is plenty).
        "runs": runs_from_audit(controller.store.audit_of(RUN_ACTIONS, RUNS_SHOWN * 40)),
        "layouts": {"window_s": LAYOUT_WINDOW_S, "latest": latest.sides,
                    "history": [{"ts": s.ts, **{side: {k: s.sides[side][k] for k in ("p99_ms", "error_rate", "rps")}
                                               for side in s.sides}} for s in history]},
        "view_without_token": view_without_token,
    }
