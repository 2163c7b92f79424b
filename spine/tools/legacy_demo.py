"""`make run LEGACY=litellm`: the demo's three runs, migrating from a real LiteLLM proxy instead
of spine's layered stack.

    python -m spine.tools.legacy_demo [--timeout-s S]

Starts `LegacyRig` (the model server, LiteLLM's proxy in front of it offline on loopback, a
collapsed spine serving the same model with LiteLLM's key imported, the HTTP front and the
controller), drives it with the official openai SDK from a few threads, and walks
deploy/plans/legacy-litellm.yaml three times: a healthy spine (promoted), a spine answering
half its calls with 5xx (rolled back by the error-rate gate), a spine answering greedy
requests differently (rolled back by parity). A table per run, a row per stage as the front
measured each side; a summary at the end. Every process is stopped by its PID at the end, on
a failure or on Ctrl-C; each run is bounded in time.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from migration.status import State
from spine.tools.legacy_rig import LegacyRig, LegacyTraffic

RUNS = (("healthy", "clear", State.PROMOTED),
        ("5xx", "error-rate 0.5", State.ROLLED_BACK),
        ("wrong answers", "wrong-answers on", State.ROLLED_BACK))


@dataclass
class RunResult:
    name: str
    state: State
    expected: State
    reason: str
    calls: int = 0
    failed: int = 0
    rows: list[tuple[str, ...]] = field(default_factory=list)


def run_once(rig: LegacyRig, name: str, fault: str, expected: State, console: Console,
             timeout_s: float) -> RunResult:
    assert rig.cutover is not None and rig.cutover.front is not None and rig.cutover.controller is not None
    front, controller = rig.cutover.front, rig.cutover.controller.controller
    rig.switch_fault("clear")
    front.set_weight(0)
    rig.switch_fault(fault)
    result = RunResult(name, State.PENDING, expected, "")
    marks: list[tuple[int, str, float, float]] = []  # (index, stage, weight, entered at)

    def entered(index: int, stage: str, weight: float) -> None:
        marks.append((index, stage, weight, time.time()))
        console.print(f"  [{name}] stage {index + 1} {stage}: spine weight {weight:g}%")

    traffic = LegacyTraffic(rig.cutover.base_url, rig.master_key).start()
    try:
        result.state = rig.walk(rig.plan_text(), timeout_s=timeout_s, actor="demo", on_stage=entered)
    finally:
        calls = traffic.stop()
        rig.switch_fault("clear")
    ended = time.time()
    for position, (_, stage, weight, at) in enumerate(marks):
        until = marks[position + 1][3] if position + 1 < len(marks) else ended
        window = front.window(at, until)
        legacy, spine = window["layered"], window["spine"]
        gates = ", ".join(f"{g.gate}:{g.verdict}" + ("(dry)" if g.dry_run else "")
                          for g in controller.view().last_gates if g.stage == stage) or "-"
        result.rows.append((stage, f"{weight:g}%", f"{legacy.requests}/{legacy.errors}",
                            f"{spine.requests}/{spine.errors}", f"{legacy.p50_ms:.1f}/{legacy.p99_ms:.1f}",
                            f"{spine.p50_ms:.1f}/{spine.p99_ms:.1f}", gates))
    audit = controller.view(audit_rows=6).recent_audit
    result.reason = next((f"{entry.action}: {entry.reason}" for entry in audit
                          if entry.action in ("promote", "rollback", "abort")), "")
    result.calls, result.failed = len(calls), sum(1 for call in calls if call.error)
    return result


def print_run(console: Console, result: RunResult) -> None:
    table = Table(title=f"{result.name}: {result.state} (expected {result.expected})")
    for column in ("stage", "spine", "legacy req/err", "spine req/err", "legacy p50/p99 ms", "spine p50/p99 ms",
                   "gates (last window)"):
        table.add_column(column)
    for row in result.rows:
        table.add_row(*row)
    console.print(table)
    console.print(f"  {result.reason}")
    console.print(f"  client calls: {result.calls}, failed: {result.failed}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spine.tools.legacy_demo", description=__doc__.splitlines()[0])
    parser.add_argument("--timeout-s", type=float, default=120.0, help="the longest one run may take")
    args = parser.parse_args(argv)
    console = Console()
    with tempfile.TemporaryDirectory(prefix="spine-legacy-demo-") as tmp:
        rig = LegacyRig(Path(tmp))
        console.print("starting the model server, LiteLLM's proxy (offline, loopback), the spine, the front ...")
        try:
            base_url = rig.start()
            console.print(f"ready in {rig.timings['all']:.1f}s (LiteLLM {rig.timings['litellm']:.1f}s); clients call "
                          f"the front at {base_url} with LiteLLM's key; legacy {rig.gateway.url if rig.gateway else ''}")
            results = []
            for name, fault, expected in RUNS:
                console.rule(f"{name}: {fault}")
                result = run_once(rig, name, fault, expected, console, args.timeout_s)
                print_run(console, result)
                results.append(result)
        except KeyboardInterrupt:
            console.print("interrupted: stopping every process")
            return 130
        finally:
            rig.stop()
    summary = Table(title="LiteLLM -> spine: three runs")
    for column in ("run", "outcome", "expected", "client calls", "failed"):
        summary.add_column(column)
    for result in results:
        summary.add_row(result.name, str(result.state), str(result.expected), str(result.calls), str(result.failed))
    console.print(summary)
    return 0 if all(result.state is result.expected for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
