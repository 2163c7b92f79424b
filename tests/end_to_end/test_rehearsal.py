"""The production path rehearsed locally: `python -m spine.tools.rehearsal.run`.

One run of the same code the command runs, every part a real process: the layered stack (its
rate limiter following the controller), two spine replicas following it (`spine up
--follow-controller`), every rate limiter leasing from one real Redis (`ratelimit.store`), a
real Prometheus server scraping both sides, the controller in xds mode
judging its gates on PromQL, and two stock proxyless gRPC clients (`xds:///spine-gateway`) as
the data plane. A short plan — placements moving at every stage — is walked to 100%; then both
replicas are restarted with the parity fault (`spine up --inject-fault wrong-answers`) and the
plan is walked again: the parity gate rolls it back.
"""

from __future__ import annotations

import argparse
import os
import textwrap
from pathlib import Path

import pytest

from migration.controller import SYSTEM_ACTOR
from migration.plan import load_plan
from runtime.faults import WrongAnswers
from services.common import ConfigError
from services.registry import close_servicer
from spine.cli.up import _injected_fault
from spine.tools.rehearsal.processes import RehearsalError
from spine.tools.rehearsal.run import REHEARSAL_PLAN, SPINES, Options, run_rehearsal, summary
from tests.conftest import config_for_tests

# Three stages instead of the shipped plan's four: a canary with the cache (and the metrics
# the spine mirrors into) collapsed, then the rest, then 100%. Windows as in the shipped plan.
SHORT_PLAN = textwrap.dedent("""\
    name: rehearsal-short
    window_s: 2
    min_window_requests: 3
    stages:
      - name: canary-cache
        spine_weight: 25
        placements: {metrics: local, cache: local}
        hold_s: 2
        gates:
          - {type: error_rate, max_delta: 0.02}
          - {type: parity, max_mismatches: 0}
          - {type: latency_p99_ratio, max_ratio: 3, min_delta_ms: 250}
      - name: the-rest
        spine_weight: 50
        placements: {auth: local, ratelimit: local, router: local, logs: local}
        hold_s: 2
        gates:
          - {type: error_rate, max_delta: 0.02}
          - {type: parity, max_mismatches: 0}
      - name: all-spine
        spine_weight: 100
        hold_s: 1
    """)


def test_the_production_path_walks_to_100_percent_then_a_parity_fault_is_rolled_back() -> None:
    report = run_rehearsal(Options(plan_text=SHORT_PLAN, clients=2, rate=8.0))
    print(summary(report))
    plan = load_plan(SHORT_PLAN)
    healthy, parity = report.runs["healthy"], report.runs["parity"]

    assert healthy.final_state == "promoted", healthy
    walked = [s for s in healthy.stages if not s.name.startswith("rollback")]
    assert [s.name for s in walked] == [s.name for s in plan.stages]
    for record, stage in zip(walked, plan.stages, strict=True):
        assert record.applied_after_s is not None, f"{stage.name} never counted as applied"
        spines = {row["node_id"]: row for row in record.followers if row["role"] == "spine"}
        assert set(spines) == set(SPINES), record.followers
        for row in spines.values():  # the stage's placements, applied and ACKed by each replica
            assert row["acked_version"].split("+")[0] == record.version and not row["nack_error"], row
            assert row["placements"] == stage.placements, (stage.name, row)
        assert set(record.data_planes) == {"proxyless-client-1", "proxyless-client-2"}
        assert all(v.split("+")[0] == record.version for v in record.data_planes.values()), record.data_planes
    # Placements moved: the clients were answered by the spine mixed, then collapsed.
    assert walked[0].answers["mixed"] > 0 and walked[-1].answers["collapsed"] > 0, [s.answers for s in walked]
    assert all(any(g["verdict"] == "pass" for g in window) for s in walked[:-1] for window in s.gates[-1:])
    # Only OK for the data plane while the healthy spine took its traffic.
    assert set(healthy.codes) == {"OK"} and healthy.codes["OK"] >= 30, (healthy.codes, healthy.errors)

    assert parity.final_state == "rolled_back", parity
    assert parity.failed_gates == ["parity"], parity
    assert "parity:" in parity.rollback_reason and "tokens" in parity.rollback_reason, parity.rollback_reason
    parity_versions = {s.version for s in parity.stages}
    failed = [g for g in report.gate_history if g.gate == "parity" and g.verdict == "fail"]
    assert failed and all(g.version in parity_versions for g in failed), report.gate_history
    assert not [g for g in report.gate_history if g.verdict == "fail" and g.version not in parity_versions]
    rollbacks = [a for a in report.audit if a.action == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0].actor == SYSTEM_ACTOR and "parity" in rollbacks[0].reason

    # Every rate limiter (the layered one, each spine's) leased from the one shared store, a
    # real Redis; the report shows it and each limiter's view after bring-up and each walk.
    assert [look.when for look in report.store] == ["after bring-up", "after the healthy walk",
                                                    "after the parity walk"]
    for look, spines in zip(report.store, ("1", "1", "2"), strict=True):
        assert look.live_replicas == 3, look.lines()  # the restarted replicas' predecessors left it
        assert [limiter.name for limiter in look.limiters] == [
            "layered-ratelimit", f"spine-a-{spines}", f"spine-b-{spines}"], look.lines()
        assert all(not limiter.error and limiter.calls_ok > 0 for limiter in look.limiters), look.lines()
    assert all(limiter.calls_per_s for limiter in report.store[1].limiters), report.store[1].lines()

    # Every process it started was stopped, by PID (the store last).
    names = {name for name, _, _ in report.stopped}
    assert {"controller", "layered", "layered-ratelimit", "prometheus", "proxyless-client-1", "proxyless-client-2",
            "spine-a-1", "spine-b-1", "spine-a-2", "spine-b-2", "redis"} <= names
    assert report.stopped[-1][0] == "redis"
    for _, pid, _ in report.stopped:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_make_rehearse_store_postgres_keeps_the_controllers_state_in_postgresql() -> None:
    """`make rehearse STORE=postgres`: the same walk, the controller's state in a PostgreSQL
    server the rehearsal starts (and stops last, by PID), the controller its elected leader."""
    report = run_rehearsal(Options(plan_text=SHORT_PLAN, clients=2, rate=8.0, parity_run=False,
                                   state_store="postgres"))
    print(summary(report))
    assert report.runs["healthy"].final_state == "promoted", report.runs["healthy"]
    # read back from PostgreSQL after the walk: every stage entered, in order, then promoted
    entered = [a.stage for a in report.audit if a.action in ("start", "advance")]
    assert entered == [s.name for s in load_plan(SHORT_PLAN).stages], report.audit
    assert report.audit[-1].action == "promote"
    # named without its password (the DSN's user, host, port and database only)
    assert report.controller_store.startswith("PostgreSQL postgresql://spine@127.0.0.1:"), report.controller_store
    assert report.controller_store.endswith("at lease epoch 1"), report.controller_store
    name, pid, _ = report.stopped[-1]
    assert name == "postgres"
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def _processes_mentioning(text: str) -> list[str]:
    """Command lines of the running processes that mention `text` (their work directory)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # not a process, or gone meanwhile
            continue
        if entry.name.isdigit() and text in argv:
            found.append(f"{entry.name}: {argv}")
    return found


def test_a_rehearsal_that_runs_out_of_time_stops_everything_it_started(tmp_path: Path) -> None:
    """Bounded in time: past its start budget it gives up, and stops every process on the way out."""
    with pytest.raises(RehearsalError, match="timed out|not ready|did not serve"):
        run_rehearsal(Options(plan_text=SHORT_PLAN, workdir=tmp_path, start_timeout_s=3.0))
    assert (tmp_path / "logs" / "controller.log").exists()  # it got as far as starting processes
    assert _processes_mentioning(str(tmp_path)) == []


def test_the_shipped_rehearsal_plan_moves_placements_at_every_stage_under_every_gate_kind() -> None:
    plan = load_plan(REHEARSAL_PLAN.read_text())
    assert plan.window_s >= 4 * 0.5  # four scrape intervals of the rehearsal's Prometheus
    locals_ = [{m for m, p in s.placements.items() if p == "local"} for s in plan.stages]
    assert all(a < b for a, b in zip(locals_, locals_[1:-1], strict=False))  # more collapsed at each step
    assert "cache" in locals_[0] and plan.stages[-1].spine_weight == 100
    for stage in plan.stages[:-1]:
        assert {g.type for g in stage.gates} == {"error_rate", "parity", "latency_p99_ratio"}


def test_the_fault_switch_is_for_rehearsals_only() -> None:
    config = config_for_tests()
    args = argparse.Namespace(inject_fault="wrong-answers", allow_external=True)
    with pytest.raises(ConfigError, match="refused with --allow-external"):
        _injected_fault(args, config, None)
    assert _injected_fault(argparse.Namespace(inject_fault=None, allow_external=False), config, None) == {}
    switched = _injected_fault(argparse.Namespace(inject_fault="wrong-answers", allow_external=False), config, None)
    model = switched["servicers"]["inference"]
    try:
        assert isinstance(model, WrongAnswers) and model._fault.wrong_answers
    finally:
        close_servicer(model._servicer)
