"""The main job (`make run`): a staged migration from the layered stack to the spine.

Both layouts start locally; synthetic traffic flows through the front, which mirrors a
share of it to the other side (shadow traffic) and exports the comparisons for the parity
gate. The same plan runs three times:

1. a healthy spine: walked to 100%, promoted;
2. a failing spine (half its model calls fail): rolled back by the error-rate gate;
3. a spine answering differently (the parity fault: greedy requests sampled, every call
   succeeds): the error gate sees nothing; rolled back by the parity gate. In the first
   stage the spine still shares the layered cache process, so most copies are answered from
   the answer their primary stored there and both sides agree (and layered clients may get
   the spine's wrong answers from it); a copy that reaches the spine before its primary's
   answer is stored shows a mismatch, and once the spine has its own cache (second stage)
   most do.

Both sides run in processes of their own, as in production: the layered stack's gateway
and components (`LayeredProcess`), and the spine (`SpineProcess`), which follows the
controller's stages over ADS and whose faults the demo switches through its stdin. Only
the front, the controller and the xDS server share this process, and both sides' requests
pass through the front alike.

Each run prints a table of its stages' weights, placements and gate results, and compares
the two sides like for like: over the requests each side's model answered OK in the stage's
window (cache hits and refusals left out: they say nothing about a layout's speed), their
p50 and p99, how many, and the mean number of requests in flight on that side when each
started (`Front.window`). The last column, the verdict, is "spine faster" when the spine's
p50 and p99 are both below the layered side's, else why not, decided from the numbers in
this order:

- "no layered requests ..." / "no spine requests ...": one side served none (the 100%
  stage has no layered baseline);
- "too few <side> requests for a p99 (n=N)": fewer than `MIN_P99_REQUESTS` (20) on a side;
  below that a p99 is the slowest request or next to it, one scheduling hiccup;
- "spine carried more concurrency (S vs L)": the spine's mean concurrency is more than
  `CONCURRENCY_RATIO` (1.25x) the layered side's and at least `CONCURRENCY_MARGIN` (0.5)
  more requests: its requests queued behind more of their own;
- "spine slower at equal or lower concurrency (p50 S vs L ms, p99 S vs L ms): see `make
  profile`": a real regression to look at.

The summary says at how many stages of the healthy run, of those with enough requests on
both sides for a p99, the spine was faster.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from migration.judge.score import METRIC_ROW
from migration.plan import load_plan
from migration.status import FINISHED, State
from migration.traffic.cutover import Cutover, RunningCutover
from migration.traffic.spine_process import FaultNotSwitched
from runtime.config.file import SpineConfig
from runtime.processes.signals import uninterrupted
from runtime.tls import link_credentials
from spine.tools.demo.screen import DemoScreen, logs_in
from spine.tools.demo.traffic import TrafficDriver

DEMO_PLAN = Path(__file__).resolve().parents[3] / "deploy" / "plans" / "demo.yaml"
# `spine demo --model DIR`: a real model answers a few requests a second on a CPU, so its plan
# judges longer windows, and every run, and the traffic, may take longer.
REAL_MODEL_PLAN = DEMO_PLAN.with_name("demo-real-model.yaml")
# The share of answered requests the front mirrors when the config leaves shadow off: the
# plan's parity gates need comparisons in every 1 s window (~20 at the demo's traffic).
DEMO_SHADOW_SHARE = 0.25
# The stage table's verdict (module docstring).
MIN_P99_REQUESTS = 20
CONCURRENCY_RATIO = 1.25
CONCURRENCY_MARGIN = 0.5
SPINE_FASTER = "spine faster"
# Where the controller's dashboard listens (loopback; default any free port, printed at start).
DASHBOARD_ENV = "SPINE_DASHBOARD_LISTEN"


@dataclass(frozen=True)
class SideLoad:
    """One side's like-for-like numbers in a stage: the requests its model answered OK."""
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    requests: int = 0
    concurrency: float = 0.0  # mean requests in flight on the side when each started


def verdict(layered: SideLoad, spine: SideLoad) -> str:
    """'spine faster', or why not (the module docstring lists the reasons and thresholds)."""
    for name, side in (("layered", layered), ("spine", spine)):
        if side.requests == 0:
            return f"no {name} requests to compare"
    for name, side in (("spine", spine), ("layered", layered)):
        if side.requests < MIN_P99_REQUESTS:
            return f"too few {name} requests for a p99 (n={side.requests})"
    if spine.p50_ms < layered.p50_ms and spine.p99_ms < layered.p99_ms:
        return SPINE_FASTER
    if (spine.concurrency > layered.concurrency * CONCURRENCY_RATIO
            and spine.concurrency - layered.concurrency >= CONCURRENCY_MARGIN):
        return f"spine carried more concurrency ({spine.concurrency:.1f} vs {layered.concurrency:.1f})"
    return (f"spine slower at equal or lower concurrency (p50 {spine.p50_ms:.1f} vs {layered.p50_ms:.1f} ms, "
            f"p99 {spine.p99_ms:.1f} vs {layered.p99_ms:.1f} ms): see `make profile`")


@dataclass
class StageRow:
    stage: str
    weight: float
    local: list[str]
    gates: str
    layered_p99: float  # over OK requests, cache hits included (what the latency gate reads)
    spine_p99: float
    requests: tuple[int, int]
    layered: SideLoad = SideLoad()  # like for like: the requests the model answered OK
    spine: SideLoad = SideLoad()

    @property
    def verdict(self) -> str:
        return verdict(self.layered, self.spine)


@dataclass
class RunReport:
    final_state: str
    rows: list[StageRow] = field(default_factory=list)
    seconds: float = 0.0
    requests: int = 0
    failed: int = 0
    failed_gates: list[str] = field(default_factory=list)  # the counting gates that failed the last window

    def outcome(self) -> str:
        if self.final_state == "rolled_back" and self.failed_gates:
            return f"rolled back by the {' and '.join(self.failed_gates)} gate"
        return self.final_state.replace("_", " ")

    def faster(self) -> str:
        """At how many stages the spine was faster, like for like, of those with enough
        requests on both sides for a p99 (the 100% stage has no layered baseline)."""
        compared = [row for row in self.rows
                    if min(row.layered.requests, row.spine.requests) >= MIN_P99_REQUESTS]
        faster = sum(row.verdict == SPINE_FASTER for row in compared)
        return f"spine faster at {faster}/{len(compared)} stages with enough requests on both sides"


def walk_plan(cutover: RunningCutover, plan_text: str, title: str, timeout_s: float = 60.0, *,
              progress: Callable[[str], None] = lambda line: None) -> RunReport:
    """Start the plan and follow it stage by stage until it finishes; `progress` is told each
    stage as it is entered, and the outcome."""
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
        window = cutover.front.window(stage_started)
        stage = plan.stages[index]
        gates = ", ".join(f"{g.gate}:{g.verdict}" + ("(dry)" if g.dry_run else "")
                          for g in view.last_gates if g.stage == stage.name) or "-"
        local = sorted(name for name, where in stage.placements.items() if where == "local")
        loads = {side: SideLoad(w.p50_model_ms, w.p99_model_ms, w.model_requests, w.mean_in_flight)
                 for side, w in window.items()}
        report.rows.append(StageRow(stage.name, stage.spine_weight, local, gates,
                                    window["layered"].p99_ms if window else 0.0,
                                    window["spine"].p99_ms if window else 0.0,
                                    (window["layered"].requests, window["spine"].requests) if window else (0, 0),
                                    loads.get("layered", SideLoad()), loads.get("spine", SideLoad())))

    while time.monotonic() < deadline:
        status = controller.status
        if status.stage_index != seen_stage and status.state is State.PROGRESSING:
            if seen_stage >= 0:
                close_row(seen_stage)
            seen_stage, stage_started = status.stage_index, time.time()
            progress(f"stage {status.stage_index + 1}/{len(plan.stages)} "
                     f"{plan.stages[status.stage_index].name}: spine weight {status.spine_weight:g}%")
        if status.state in FINISHED and status.state is not State.PENDING:
            break
        time.sleep(0.1)
    status = controller.status
    if seen_stage >= 0:
        close_row(seen_stage)
    report.final_state = status.state.value
    report.seconds = time.time() - started
    if status.state is State.ROLLED_BACK:
        report.failed_gates = sorted({g.gate for g in controller.view().last_gates  # a judge's metric rows never count
                                      if g.verdict == "fail" and not g.dry_run and not g.gate.startswith(METRIC_ROW)})
    progress(f"finished: {report.outcome()} with spine weight {status.spine_weight:g}% after {report.seconds:.1f}s")
    return report


def stage_table(title: str, report: RunReport, fault: str = "") -> Group:
    """Latencies and counts over the requests each side's model answered OK in the stage,
    then one line per stage with its verdict (a column of sentences would not fit)."""
    table = Table(title=title, caption="ms and requests: answered OK by the model (no cache hits); "
                                       "concurrency: mean requests in flight on the side as each started")
    for column in ("stage", "spine %", "collapsed middlewares", "gates (last window)", "layered p50/p99 ms",
                   "spine p50/p99 ms", "requests L/S", "concurrency L/S"):
        table.add_column(column, max_width=22 if "middlewares" in column or "gates" in column else None)
    for row in report.rows:
        table.add_row(row.stage, f"{row.weight:g}", ", ".join(row.local) or "-", row.gates,
                      f"{row.layered.p50_ms:.1f}/{row.layered.p99_ms:.1f}", f"{row.spine.p50_ms:.1f}/{row.spine.p99_ms:.1f}",
                      f"{row.layered.requests}/{row.spine.requests}",
                      f"{row.layered.concurrency:.1f}/{row.spine.concurrency:.1f}")
    verdicts = [Text(f"  {row.stage} ({row.weight:g}% spine): {row.verdict}") for row in report.rows]
    return Group(table, *([Text(f"  the fault injected: {fault}")] if fault else []), *verdicts)


def for_real_model(config: SpineConfig) -> tuple[SpineConfig, dict[str, Any]]:
    """`spine demo --model DIR`: the config (the model deterministic, so both layouts answer bit for
    bit alike and the parity gate judges the model, not float rounding between batch shapes) and
    `run_migration_demo`'s pace (REAL_MODEL_PLAN's longer windows, longer stages and traffic)."""
    return (config.with_overrides({"inference": {"deterministic": True}}),
            {"plan_path": REAL_MODEL_PLAN, "stage_timeout_s": 240.0, "traffic_time_limit_s": 1200.0})


def run_migration_demo(config: SpineConfig, plan_path: Path = DEMO_PLAN,
                       console: Console | None = None, runs: tuple[str, ...] = ("healthy", "failing", "parity"),
                       *, stage_timeout_s: float = 60.0, traffic_time_limit_s: float = 110.0,
                       run_dir: Path | None = None, interactive: bool | None = None, model: str | None = None) -> int:
    """Start everything, walk the plan once per run in `runs` (in that order), print the summary.

    0 when every run ended as it should: healthy promoted, failing rolled back by the
    error-rate gate, parity rolled back by the parity gate (and no other). `run_dir` (default:
    a fresh one under the temporary directory) is kept, with every log, the front's final
    metrics and the controller's history; `interactive` (default: stdin and stdout are
    terminals) keeps the dashboard served after the runs until Enter or Ctrl-C. `model` is the
    router model the traffic asks for (default: the built-in `inference.model_id`), e.g. an
    engine's `upstream:` entry."""
    screen = DemoScreen(console, interactive=interactive)
    if config.shadow.share <= 0:  # the parity gates read shadow comparisons
        config = config.with_overrides({"shadow": {"share": DEMO_SHADOW_SHARE}})
    run_dir = run_dir or Path(tempfile.mkdtemp(prefix="spine-demo-"))
    try:
        with logs_in(run_dir / DEMO_LOG) as log_path:
            screen.say(f"log: {log_path} (every log line of the demo; each process's log is beside it)")
            return _demo(config, plan_path.read_text(), screen, runs, run_dir, stage_timeout_s,
                         traffic_time_limit_s, model or config.inference.model_id)
    finally:
        forget_secrets(run_dir)


def _demo(config: SpineConfig, plan_text: str, screen: DemoScreen, runs: tuple[str, ...], run_dir: Path,
          stage_timeout_s: float, traffic_time_limit_s: float, model: str) -> int:
    from runtime.config.file import dev_api_key

    reports: dict[str, RunReport] = {}
    # Each side in processes of its own, as in production (`SpineProcess`, `LayeredProcess`):
    # the tables compare the two layouts, not the harness's share of this interpreter.
    spec = Cutover(config, run_dir, xds_listen="127.0.0.1:0", layered_process=True, spine_process=True,
                   http_listen="127.0.0.1:0", dashboard_listen=os.environ.get(DASHBOARD_ENV, "127.0.0.1:0"))
    cutover: RunningCutover | None = None
    traffic: TrafficDriver | None = None
    try:  # whatever stops the demo (Ctrl-C, SIGTERM via `spine demo`, an error) stops all it started
        with screen.busy("starting the layered stack (8 processes), the spine (1), the front and the controller"):
            began = time.monotonic()
            cutover = spec.start()  # one that stops half way has stopped what it started
        assert cutover.front.shadow is not None
        token_file = run_dir / "admin-token"
        screen.say(f"both layouts up in {time.monotonic() - began:.1f}s; front on {cutover.address} (gRPC) and "
                   f"http://{cutover.http_address}/v1 (OpenAI/Anthropic HTTP, a quarter of the traffic); it mirrors "
                   f"{cutover.front.shadow.share:.0%} of the answers to the other side and compares them")
        screen.note(f"comparisons on http://{cutover.front_metrics_address}/metrics; controller on "
                    f"{cutover.controller_address} (`spine migrate status --watch --controller "
                    f"{cutover.controller_address} --admin-token-file {token_file}`); xDS (ADS) for Envoy and "
                    f"proxyless clients on {cutover.xds.address if cutover.xds else '-'}")
        kept = "it stays up after the runs" if screen.interactive else "open it while the demo runs"
        screen.note(f"dashboard: {cutover.controller.dashboard_url} (its buttons take the admin token in "
                    f"{token_file})")
        screen.secret_line(f"dashboard: {cutover.controller.dashboard_link} ({kept}; the link carries the admin "
                           f"token, in {token_file}, and unlocks the buttons)")
        # The clients in a process of their own, as they are in production (TrafficDriver).
        tls = config.tls
        traffic = TrafficDriver(cutover.address, dev_api_key(config) or "", own_process=True,
                                time_limit_s=traffic_time_limit_s,
                                tls=tls if link_credentials(tls, cutover.address) is not None else None,
                                http_address=cutover.http_address,
                                model=model)
        traffic.start()
        # The traffic process takes a moment to start: the first stage's window should not.
        flowing = time.monotonic() + 15.0
        while not cutover.front.outcomes and time.monotonic() < flowing:
            time.sleep(0.05)
        for number, run in enumerate(runs, 1):
            title, table, fault = RUNS[run]
            failed_before = traffic.failed
            with screen.run_status(f"Run {number}/{len(runs)}: {title}") as status:
                if fault:
                    status.update(f"injecting a fault into the spine: {fault}")
                    inject(cutover, run)
                reports[run] = walk_plan(cutover, plan_text, title, stage_timeout_s, progress=status.update)
                if fault:
                    cutover.switch_fault("clear")
                traffic.settle()
            reports[run].failed = traffic.failed - failed_before
            screen.show(stage_table(f"Run {number}: {table}", reports[run], fault))
        for entry in cutover.controller.controller.view(audit_rows=4 * len(runs)).recent_audit:
            screen.note(f"audit: {entry.action} {entry.from_state}->{entry.to_state} "
                        f"stage={entry.stage} by {entry.actor}: {entry.reason}")
        shadow = cutover.front.shadow
        shadow.wait_idle(5.0)
        counts = shadow.stats()["counts"]
        metrics = write_final_metrics(shadow.counters.registry, run_dir / FRONT_METRICS)
        ok = all((report.final_state, report.failed_gates) == EXPECTED[run] for run, report in reports.items())
        screen.show(summary(reports, traffic.sent, counts, run_dir, metrics), soft_wrap=True)  # a line each
        if screen.interactive:
            traffic.close()
            screen.keep_open(f"dashboard still served at {cutover.controller.dashboard_url} with the "
                             f"{len(reports)} runs' history")
        return 0 if ok else 1
    except FaultNotSwitched as error:  # the spine process is gone or stuck: say so, with its log
        screen.say(f"[red]the demo cannot go on: {error}[/red]")
        if cutover is not None and cutover.spine_tree is not None:
            screen.say(f"the spine process's log ends:\n{cutover.spine_tree.log_tail()}")
        return 1
    finally:
        with uninterrupted(), screen.busy("stopping both layouts, the controller and the traffic"):
            if traffic is not None:  # a second Ctrl-C must not leave processes behind
                traffic.close()
            if cutover is not None:
                cutover.stop()


# How each run should end: (final state, the counting gates that failed its last window).
EXPECTED: dict[str, tuple[str, list[str]]] = {"healthy": ("promoted", []), "failing": ("rolled_back", ["error_rate"]),
                                              "parity": ("rolled_back", ["parity"])}
DEMO_LOG = "demo.log"
FRONT_METRICS = "front-metrics.prom"


def summary(reports: Mapping[str, RunReport], sent: int, counts: Mapping[str, int], run_dir: Path,
            metrics: Path) -> Group:
    """The last thing on the screen: the traffic, the comparisons, and each run's outcome."""
    mismatched = counts.get("mismatched", 0)
    lines = [Text(f"summary: {sent} requests through the front; {counts.get('compared', 0)} mirrored answers "
                  f"compared across layouts, {mismatched} differed (each one in {run_dir / DEMO_LOG}, counted "
                  f"in spine_shadow_mismatched_total: {metrics.name} there)")]
    lines += [Text(f"  {number}. {RUNS[run][0]} → {report.outcome()} in {report.seconds:.1f}s "
                   f"({report.failed} failed by a layout; {report.faster()})")
              for number, (run, report) in enumerate(reports.items(), 1)]
    return Group(*lines)


def write_final_metrics(registry: CollectorRegistry, path: Path) -> Path:
    """The front's shadow counters as its /metrics last served them (it stops with the demo)."""
    path.write_bytes(generate_latest(registry))
    return path


def forget_secrets(run_dir: Path) -> None:
    """The kept run directory without what holds a secret: the config copies (API keys, the
    internal secret) and the admin token of a controller that is gone."""
    for path in [run_dir / "admin-token", *run_dir.rglob("*config.yaml")]:
        path.unlink(missing_ok=True)


# run -> (its name in progress lines and the summary, its table's title, the fault it injects)
RUNS: dict[str, tuple[str, str, str]] = {
    "healthy": ("healthy spine", "a healthy spine, walked to 100%", ""),
    "failing": ("failing spine", "a failing spine, rolled back by the error-rate gate",
                "half of its model calls fail with UNAVAILABLE"),
    "parity": ("spine answering differently", "a spine answering differently, rolled back by the parity gate",
               "it samples greedy requests (a parity fault: every call succeeds, the answers differ)"),
}


# run -> the `FaultSwitch` command that makes the spine misbehave as the run's title says
FAULTS: dict[str, str] = {"failing": "error-rate 0.5", "parity": "wrong-answers on"}


def inject(cutover: RunningCutover, run: str) -> None:
    """The fault of `run`, switched in the spine's process (`runtime.faults.FaultSwitch`)."""
    if run in FAULTS:
        cutover.switch_fault(FAULTS[run])
