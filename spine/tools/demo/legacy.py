"""`make run LEGACY=litellm`: the demo's three runs, migrating from a real LiteLLM proxy instead
of spine's layered stack.

    python -m spine.tools.demo.legacy [--timeout-s S]

Starts `LegacyRig` (the model server, LiteLLM's proxy in front of it offline on loopback, a
collapsed spine serving the same model with LiteLLM's key imported, the HTTP front and the
controller), drives it with the official openai SDK from a few threads, and walks
deploy/plans/legacy-litellm.yaml three times: a healthy spine (promoted), a spine answering
half its calls with 5xx (rolled back by the error-rate gate), a spine answering greedy
requests differently (rolled back by parity). A table per run, a row per stage as the front
measured each side; a summary at the end. The screen is the demo's (`DemoScreen`): every log
line (each shadow mismatch among them) goes to `demo.log` in the run directory, which is kept
with every process's log. Every process is stopped by its PID at the end, on a failure or on
Ctrl-C; each run is bounded in time.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from rich.table import Table

from migration.status import State
from runtime.observability.client_logs import quiet_http_clients
from spine.tools.demo.legacy_rig import LegacyRig, LegacyTraffic
from spine.tools.demo.screen import DemoScreen, RunStatus, logs_in

DEMO_LOG = "demo.log"

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


def run_once(rig: LegacyRig, name: str, fault: str, expected: State, status: RunStatus,
             timeout_s: float) -> RunResult:
    assert rig.cutover is not None and rig.cutover.front is not None and rig.cutover.controller is not None
    front, controller = rig.cutover.front, rig.cutover.controller.controller
    rig.switch_fault("clear")
    front.set_weight(0)
    rig.switch_fault(fault)
    status.update(f"the spine's fault: {fault}")
    result = RunResult(name, State.PENDING, expected, "")
    marks: list[tuple[int, str, float, float]] = []  # (index, stage, weight, entered at)

    def entered(index: int, stage: str, weight: float) -> None:
        marks.append((index, stage, weight, time.time()))
        status.update(f"stage {index + 1} {stage}: spine weight {weight:g}%")

    traffic = LegacyTraffic(rig.cutover.base_url, rig.master_key).start()
    try:
        result.state = rig.walk(rig.plan_text(), timeout_s=timeout_s, actor="demo", on_stage=entered)
        if result.state not in (State.PROMOTED, State.ROLLED_BACK, State.ABORTED):  # out of time: end it
            controller.abort(actor="demo", reason=f"run {name!r} did not finish within {timeout_s:g}s")
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
    result.reason = next((f"{entry.action}: {entry.reason}" for entry in reversed(audit)  # oldest first
                          if entry.action in ("promote", "rollback", "abort")), "")
    result.calls, result.failed = len(calls), sum(1 for call in calls if call.error)
    return result


def run_table(result: RunResult) -> Table:
    table = Table(title=f"{result.name}: {result.state} (expected {result.expected}); client calls "
                        f"{result.calls}, failed {result.failed}", caption=result.reason)
    for column in ("stage", "spine", "legacy req/err", "spine req/err", "legacy p50/p99 ms", "spine p50/p99 ms",
                   "gates (last window)"):
        table.add_column(column)
    for row in result.rows:
        table.add_row(*row)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spine.tools.demo.legacy", description=__doc__.splitlines()[0])
    parser.add_argument("--timeout-s", type=float, default=120.0, help="the longest one run may take")
    parser.add_argument("--run-dir", type=Path, help="where every log is kept (default: a fresh temporary one)")
    args = parser.parse_args(argv)
    screen = DemoScreen()
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="spine-legacy-demo-"))
    try:
        with logs_in(run_dir / DEMO_LOG) as log_path, quiet_clients():
            screen.say(f"log: {log_path} (every log line; LiteLLM's, the spine's and the model server's beside it)")
            return _demo(screen, run_dir, args.timeout_s)
    finally:
        forget_secrets(run_dir)


@contextlib.contextmanager
def quiet_clients() -> Iterator[None]:
    """The HTTP clients' per-request INFO lines (thousands a run) left out of the log meanwhile."""
    saved = quiet_http_clients()
    try:
        yield
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


def forget_secrets(run_dir: Path) -> None:
    """The kept run directory without what holds a key: LiteLLM's config (its master key and the
    model server's), the spine's config copy (the imported key's digest, the internal secret)
    and the controller's admin token."""
    for path in [*run_dir.rglob("admin-token"), *run_dir.rglob("*config.yaml"), *run_dir.rglob("litellm.yaml")]:
        path.unlink(missing_ok=True)


def _demo(screen: DemoScreen, run_dir: Path, timeout_s: float) -> int:
    rig = LegacyRig(run_dir)
    results: list[RunResult] = []
    try:
        with screen.busy("starting the model server, LiteLLM's proxy (offline, loopback), the spine, the front"):
            base_url = rig.start()
        screen.say(f"ready in {rig.timings['all']:.1f}s (LiteLLM's proxy alone {rig.timings['litellm']:.1f}s); "
                   f"clients call the front at {base_url} with LiteLLM's key; it splits them between LiteLLM at "
                   f"{rig.gateway.url if rig.gateway else '-'} and the spine, and compares "
                   f"{rig.shadow_share:.0%} of the answers")
        for number, (name, fault, expected) in enumerate(RUNS, 1):
            with screen.run_status(f"Run {number}/{len(RUNS)}: {name}") as status:
                result = run_once(rig, name, fault, expected, status, timeout_s)
            screen.show(run_table(result))
            results.append(result)
            if rig.gateway is not None and not rig.gateway.alive():  # nothing left to migrate from
                screen.say(f"[red]LiteLLM's proxy exited during the run: its calls failed, counted on its "
                           f"side, and the stage held. Its log ends:[/red]\n{rig.gateway.log_tail()}")
                break
    except KeyboardInterrupt:
        screen.say("interrupted: stopping every process")
        return 130
    finally:
        with screen.busy("stopping LiteLLM, the spine, the model server and the front"):
            rig.stop()
    summary = Table(title="LiteLLM -> spine: three runs")
    for column in ("run", "outcome", "expected", "client calls", "failed"):
        summary.add_column(column)
    for result in results:
        summary.add_row(result.name, str(result.state), str(result.expected), str(result.calls), str(result.failed))
    screen.show(summary)
    return 0 if all(result.state is result.expected for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
