"""The main job (`make run`): a staged migration from the layered stack to the spine.

Both layouts start locally; synthetic traffic flows through the front; the controller
walks the demo plan to 100% spine, one stage at a time, printing each stage's weights,
placements, gate results and both sides' p99. Then the same plan runs again with a fault
injected into the spine, and the gates roll it back on their own.
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from migration.plan import load_plan
from migration.status import FINISHED, State
from migration.traffic.cutover import Cutover
from spine.tools.workload import Item, mixed_workload, run_workload

DEMO_PLAN = Path(__file__).resolve().parents[2] / "deploy" / "plans" / "demo.yaml"


@dataclass
class StageRow:
    stage: str
    weight: float
    local: list[str]
    gates: str
    layered_p99: float
    spine_p99: float
    requests: tuple[int, int]


@dataclass
class RunReport:
    final_state: str
    rows: list[StageRow] = field(default_factory=list)
    seconds: float = 0.0
    requests: int = 0
    failed: int = 0


class TrafficDriver:
    """Synthetic traffic through the front until stopped (bounded in time regardless)."""

    def __init__(self, address: str, api_key: str, concurrency: int = 4, time_limit_s: float = 90.0) -> None:
        self.address = address
        self.api_key = api_key
        self.concurrency = concurrency
        self.time_limit_s = time_limit_s
        self.stop = threading.Event()
        self.sent = 0
        self.failed = 0
        self._thread = threading.Thread(target=self._run, name="traffic", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        deadline = time.monotonic() + self.time_limit_s
        batch = 0
        while not self.stop.is_set() and time.monotonic() < deadline:
            items = [Item(i.request, i.token, i.stream, (("x-session-id", f"session-{batch}-{n % 40}"),))
                     for n, i in enumerate(mixed_workload(40, self.api_key, seed=batch, max_tokens=(2, 6),
                                                          invalid_share=0.0, unauthenticated_share=0.02))]
            results = run_workload(self.address, items, concurrency=self.concurrency,
                                   time_limit_s=max(0.1, deadline - time.monotonic()))
            done = [r for r in results if r is not None]
            self.sent += len(done)
            self.failed += sum(1 for r in done if r.code.name in ("UNAVAILABLE", "INTERNAL", "UNKNOWN"))
            batch += 1

    def close(self) -> None:
        self.stop.set()
        self._thread.join(timeout=30)


def walk_plan(cutover: Cutover, plan_text: str, console: Console, title: str, timeout_s: float = 60.0) -> RunReport:
    """Start the plan and follow it stage by stage until it finishes."""
    assert cutover.controller is not None and cutover.front is not None
    controller = cutover.controller.controller
    plan = load_plan(plan_text)
    started = time.time()
    controller.start(plan, actor="demo", reason=title)
    report = RunReport(final_state="")
    seen_stage = -1
    stage_started = started
    deadline = time.monotonic() + timeout_s

    def close_row(index: int) -> None:
        view = controller.view()
        window = cutover.front.window(stage_started) if cutover.front else {}
        stage = plan.stages[index]
        gates = ", ".join(f"{g.gate}:{g.verdict}" + ("(dry)" if g.dry_run else "")
                          for g in view.last_gates if g.stage == stage.name) or "-"
        local = sorted(name for name, where in stage.placements.items() if where == "local")
        report.rows.append(StageRow(stage.name, stage.spine_weight, local, gates,
                                    window["layered"].p99_ms if window else 0.0,
                                    window["spine"].p99_ms if window else 0.0,
                                    (window["layered"].requests, window["spine"].requests) if window else (0, 0)))

    while time.monotonic() < deadline:
        status = controller.status
        if status.stage_index != seen_stage and status.state is State.PROGRESSING:
            if seen_stage >= 0:
                close_row(seen_stage)
            seen_stage, stage_started = status.stage_index, time.time()
            console.print(f"  [{title}] stage {status.stage_index + 1}/{len(plan.stages)} "
                          f"{plan.stages[status.stage_index].name}: spine weight {status.spine_weight:g}%")
        if status.state in FINISHED and status.state is not State.PENDING:
            break
        time.sleep(0.1)
    status = controller.status
    if seen_stage >= 0:
        close_row(seen_stage)
    report.final_state = status.state.value
    report.seconds = time.time() - started
    console.print(f"  [{title}] finished: {status.state.value} with spine weight {status.spine_weight:g}% "
                  f"after {report.seconds:.1f}s")
    return report


def stage_table(title: str, report: RunReport) -> Table:
    table = Table(title=title)
    for column in ("stage", "spine %", "collapsed middlewares", "gates (last window)", "layered p99 ms",
                   "spine p99 ms", "requests L/S"):
        table.add_column(column)
    for row in report.rows:
        table.add_row(row.stage, f"{row.weight:g}", ", ".join(row.local) or "-", row.gates,
                      f"{row.layered_p99:.1f}", f"{row.spine_p99:.1f}", f"{row.requests[0]}/{row.requests[1]}")
    return table


def run_migration_demo(config: Mapping[str, Any], plan_path: Path = DEMO_PLAN,
                       console: Console | None = None) -> int:
    from spine.runtime.config import dev_api_key

    console = console or Console(width=None if Console().is_terminal else 140)
    plan_text = plan_path.read_text()
    with tempfile.TemporaryDirectory(prefix="spine-demo-") as tmp:
        cutover = Cutover(config, Path(tmp), xds_listen="127.0.0.1:0")
        with console.status("starting the layered stack (8 processes), the spine, the front and the controller"):
            began = time.monotonic()
            cutover.start()
        console.print(f"both layouts up in {time.monotonic() - began:.1f}s; front on {cutover.address}; "
                      f"controller on {cutover.controller_address}; xDS (ADS) for Envoy and proxyless "
                      f"clients on {cutover.xds.address if cutover.xds else '-'}")
        traffic = TrafficDriver(cutover.address, dev_api_key(config) or "")
        traffic.start()
        try:
            healthy = walk_plan(cutover, plan_text, console, "healthy spine")
            console.print(stage_table("Run 1: a healthy spine, walked to 100%", healthy))
            failed_healthy = traffic.failed
            cutover.fault.error_rate = 0.5
            console.print("injecting a fault into the spine: half of its model calls fail with UNAVAILABLE")
            faulty = walk_plan(cutover, plan_text, console, "faulty spine")
            cutover.fault.clear()
            console.print(stage_table("Run 2: a faulty spine, rolled back by the gates", faulty))
            assert cutover.controller is not None
            audit = cutover.controller.controller.view(audit_rows=6).recent_audit
            for entry in audit:
                console.print(f"  audit: {entry.action} {entry.from_state}->{entry.to_state} "
                              f"stage={entry.stage} by {entry.actor}: {entry.reason}")
        finally:
            traffic.close()
            cutover.stop()
    ok = healthy.final_state == "promoted" and faulty.final_state == "rolled_back"
    console.print(
        f"summary: healthy run {healthy.final_state} in {healthy.seconds:.1f}s; faulty run {faulty.final_state} "
        f"in {faulty.seconds:.1f}s; {traffic.sent} requests through the front; failed by a layout: "
        f"{failed_healthy} during the healthy run, {traffic.failed - failed_healthy} after the fault was injected")
    return 0 if ok else 1
