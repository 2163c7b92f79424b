"""The migration state machine: operator commands plus a tick that reconciles the plan.

States: pending → progressing ⇄ paused, progressing → awaiting_approval → progressing,
the last stage → promoted; any live state → rolling_back → rolled_back (→ resume retries
the stage that failed); abort = rollback + terminal.

Rules every command follows:
- Idempotent: a command whose effect already holds (pause while paused, rollback while
  rolled back, advance/approve to the stage already current) succeeds and records nothing.
- A command that makes no sense in the state raises InvalidTransition and changes nothing.
- The data path is told first (`target.apply`), then the transition is persisted with its
  audit row in one transaction; a failed apply changes nothing, and after a crash the
  persisted stage is re-applied, so the record and the data path agree again.

Restart: `Controller.open` re-applies the persisted weights and placements under a new
version and resumes the same stage. The hold timer CONTINUES from the persisted stage
start: the data path kept serving the stage's weights while the controller was down, and
a controller restart (a redeploy, a node drain) must not reset a 30-minute hold. It is not
a shortcut: the window restarts, so the stage still needs a fresh passing window after
the data planes ACK the re-applied version before it can advance.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from typing import Any

from migration.gates import GateResult, Verdict, evaluate, window_verdict
from migration.plan import Plan, Stage, load_plan
from migration.status import FINISHED, WATCHED, AuditEntry, GateRecord, RolloutStatus, State, all_remote
from migration.store import Store
from migration.target import TrafficTarget
from services.common import Clock

SYSTEM_ACTOR = "controller"


class InvalidTransition(Exception):
    """The command makes no sense in the rollout's current state; nothing was changed."""


@dataclass(frozen=True)
class StatusView:
    """The status plus what a person reads beside it (stage, hold progress, last gates)."""

    status: RolloutStatus
    plan: Plan | None
    stage: Stage | None
    awaiting_stage: str
    stage_elapsed_s: float
    last_gates: list[GateRecord]
    recent_audit: list[AuditEntry]
    data_planes: tuple[dict[str, Any], ...] = ()  # from targets that serve xDS


class Controller:
    def __init__(self, store: Store, target: TrafficTarget, *, clock: Clock = time.time) -> None:
        self._store = store
        self._target = target
        self._clock = clock
        self._cond = threading.Condition(threading.RLock())
        self._status = store.load() or RolloutStatus(updated_at=clock())
        self._plan = load_plan(self._status.plan_yaml) if self._status.plan_yaml else None

    @classmethod
    def open(cls, db_path: str, target: TrafficTarget, *, clock: Clock = time.time) -> Controller:
        """Open (or create) the db and re-apply whatever stage it records (see module doc)."""
        controller = cls(Store.open(db_path), target, clock=clock)
        controller._recover()
        return controller

    def close(self) -> None:
        self._store.close()

    # --- reading -------------------------------------------------------------------------

    @property
    def status(self) -> RolloutStatus:
        with self._cond:
            return replace(self._status, placements=dict(self._status.placements))

    @property
    def plan(self) -> Plan | None:
        return self._plan

    @property
    def store(self) -> Store:
        return self._store

    def view(self, now: float | None = None, audit_rows: int = 10) -> StatusView:
        with self._cond:
            status = self.status
            stage = self._stage()
            awaiting = ""
            if self._plan and status.state is State.AWAITING_APPROVAL:
                awaiting = self._plan.stages[status.stage_index + 1].name
            now = self._clock() if now is None else now
            elapsed = now - status.stage_started_at if status.stage_started_at is not None else 0.0
            if status.state is State.PAUSED and status.paused_at is not None and status.stage_started_at:
                elapsed = status.paused_at - status.stage_started_at
            history = self._store.gate_history(50)
            last = [r for r in history if history and r.window_end == history[-1].window_end]
            planes = getattr(self._target, "data_planes", None)
            return StatusView(status, self._plan, stage, awaiting, max(0.0, elapsed), last,
                              self._store.recent_audit(audit_rows), tuple(planes() if planes else ()))

    def wait_for_audit(self, after_id: int, timeout: float) -> list[AuditEntry]:
        """Audit rows after `after_id`, waiting up to `timeout` s for one to appear."""
        with self._cond:
            rows = self._store.audit(after_id)
            if not rows:
                self._cond.wait(timeout)
                rows = self._store.audit(after_id)
            return rows

    # --- commands ------------------------------------------------------------------------

    def load(self, plan: Plan, actor: str, reason: str = "") -> RolloutStatus:
        """Make `plan` the pending plan (only while nothing is in flight)."""
        with self._cond:
            s = self._status
            if s.state is State.PENDING and s.plan_yaml == plan.source:
                return self.status
            if s.state not in FINISHED:
                raise InvalidTransition(self._busy(f"cannot load plan {plan.name!r}"))
            previous = self._plan
            self._plan = plan
            try:
                return self._move(State.PENDING, "load", actor, reason or f"loaded plan {plan.name!r}",
                                  plan_name=plan.name, plan_yaml=plan.source, stage_index=0)
            except BaseException:
                self._plan = previous
                raise

    def start(self, plan: Plan | None, actor: str, reason: str = "") -> RolloutStatus:
        """Begin the plan (or the loaded one) at its first stage."""
        with self._cond:
            plan = plan or self._plan
            s = self._status
            if plan is None:
                raise InvalidTransition("no plan to start: load one with Plan (spine migrate plan FILE) "
                                        "or pass it to Start")
            if s.state not in FINISHED:
                if s.plan_yaml == plan.source and s.state is not State.ROLLING_BACK:
                    return self.status  # a retried start of the running plan
                raise InvalidTransition(self._busy(f"cannot start plan {plan.name!r}"))
            previous = self._plan
            self._plan = plan
            try:
                return self._enter(0, State.PROGRESSING, "start", actor, reason or f"start plan {plan.name!r}",
                                   plan_name=plan.name, plan_yaml=plan.source)
            except BaseException:
                self._plan = previous
                raise

    def advance(self, stage: str | None, actor: str, reason: str = "") -> RolloutStatus:
        """Skip to `stage` (default: the next one) now, ignoring hold and gates."""
        with self._cond:
            s, plan = self._status, self._plan
            if s.state not in (State.PROGRESSING, State.PAUSED, State.AWAITING_APPROVAL) or plan is None:
                raise InvalidTransition(f"cannot advance: the rollout is {s.state}{self._hint()}")
            if stage is None:
                index = s.stage_index + 1
            else:
                found = plan.stage_index(stage)
                if found is None:
                    names = ", ".join(st.name for st in plan.stages)
                    raise InvalidTransition(f"unknown stage {stage!r}; plan {plan.name!r} has: {names}")
                if found == s.stage_index:
                    return self.status
                if found < s.stage_index:
                    raise InvalidTransition(f"stage {stage!r} is behind the current stage "
                                            f"{plan.stages[s.stage_index].name!r}; use rollback to go back")
                index = found
            reason = reason or "advanced by operator"
            if index >= len(plan.stages):
                return self._move(State.PROMOTED, "promote", actor, reason)
            return self._enter(index, State.PROGRESSING, "advance", actor, reason)

    def pause(self, actor: str, reason: str = "") -> RolloutStatus:
        """Stop evaluating and advancing; the stage's weights stay as they are."""
        with self._cond:
            s = self._status
            if s.state is State.PAUSED:
                return self.status
            if s.state not in WATCHED:
                raise InvalidTransition(f"cannot pause: the rollout is {s.state}{self._hint()}")
            return self._move(State.PAUSED, "pause", actor, reason, paused_at=self._clock(),
                              resume_state=str(s.state))

    def resume(self, actor: str, reason: str = "") -> RolloutStatus:
        """Continue a paused rollout; after a rollback, retry the stage that rolled back."""
        with self._cond:
            s = self._status
            if s.state in WATCHED:
                return self.status
            if s.state is State.ROLLED_BACK:
                return self._enter(s.stage_index, State.PROGRESSING, "retry", actor,
                                   reason or "retry the stage that rolled back")
            if s.state is not State.PAUSED:
                raise InvalidTransition(f"cannot resume: the rollout is {s.state}{self._hint()}")
            now = self._clock()
            paused_for = now - (s.paused_at if s.paused_at is not None else now)
            started = s.stage_started_at + paused_for if s.stage_started_at is not None else None
            # The hold does not count paused time; the window in progress is discarded.
            return self._move(State(s.resume_state or State.PROGRESSING), "resume", actor, reason,
                              stage_started_at=started, window_started_at=now if s.acked else None,
                              last_verdict="", paused_at=None, resume_state="")

    def approve(self, stage: str | None, actor: str, reason: str = "") -> RolloutStatus:
        """Let the rollout enter the stage that waits for manual approval."""
        with self._cond:
            s, plan = self._status, self._plan
            current = plan.stages[s.stage_index].name if plan else ""
            if s.state is State.AWAITING_APPROVAL and plan is not None:
                awaited = plan.stages[s.stage_index + 1].name
                if stage is not None and stage != awaited:
                    raise InvalidTransition(f"stage {stage!r} is not awaiting approval; {awaited!r} is")
                return self._enter(s.stage_index + 1, State.PROGRESSING, "approve", actor,
                                   reason or f"approved entering {awaited!r}")
            if stage is not None and stage == current and s.state in (State.PROGRESSING, State.PAUSED):
                return self.status  # a retried approval that already took effect
            raise InvalidTransition(f"nothing awaits approval: the rollout is {s.state}"
                                    + (f" at stage {current!r}" if current else "") + self._hint())

    def rollback(self, actor: str, reason: str = "") -> RolloutStatus:
        """All traffic to the layered side, the spine's placements to the previous stage's."""
        with self._cond:
            s = self._status
            if s.state in (State.ROLLING_BACK, State.ROLLED_BACK, State.ABORTED):
                return self.status
            if s.state is State.PENDING:
                raise InvalidTransition("nothing to roll back: no rollout has started")
            self._roll_back(State.ROLLING_BACK, "rollback", actor, reason or "rolled back by operator")
            return self._settle_rollback()

    def abort(self, actor: str, reason: str = "") -> RolloutStatus:
        """Roll back and stop for good: only a new `start` leaves the aborted state."""
        with self._cond:
            s = self._status
            if s.state is State.ABORTED:
                return self.status
            if s.state is State.PENDING:
                raise InvalidTransition("nothing to abort: no rollout has started")
            reason = reason or "aborted by operator"
            if s.state in (State.ROLLING_BACK, State.ROLLED_BACK):
                return self._move(State.ABORTED, "abort", actor, reason)
            return self._roll_back(State.ABORTED, "abort", actor, reason)

    # --- reconciling ---------------------------------------------------------------------

    def tick(self, now: float | None = None) -> RolloutStatus:
        """One reconcile step: ACKs, window evaluation, automatic advance or rollback."""
        with self._cond:
            now = self._clock() if now is None else now
            if self._status.state is State.ROLLING_BACK:
                return self._settle_rollback()
            stage = self._stage()
            if self._status.state not in WATCHED or stage is None or self._plan is None:
                return self.status
            s = self._status
            if not s.acked:
                if not self._target.applied(s.version):
                    return self.status
                started = s.stage_started_at if s.stage_started_at is not None else now
                s = self._save(acked=True, stage_started_at=started, window_started_at=now, updated_at=now)
            start = s.window_started_at if s.window_started_at is not None else now
            if now - start >= self._plan.window_s:
                layered, spine, mismatches = self._target.window_stats(since=start)
                results = evaluate(stage.gates, layered, spine, mismatches, self._plan.min_window_requests)
                verdict = window_verdict(results)
                failures = {Verdict.FAIL: s.consecutive_failures + 1, Verdict.PASS: 0}.get(
                    verdict, s.consecutive_failures)
                s = self._save(window_started_at=now, stage_requests=s.stage_requests + spine.requests,
                               last_verdict=str(verdict), consecutive_failures=failures, updated_at=now,
                               gates=[(r, stage.name, start, now) for r in results])
                if verdict is Verdict.FAIL and failures >= stage.failure_limit:
                    self._roll_back(State.ROLLING_BACK, "rollback", SYSTEM_ACTOR,
                                    _failure_reason(results, failures, stage.failure_limit))
                    return self._settle_rollback()
            if s.state is State.PROGRESSING and self._stage_done(stage, now):
                return self._next_stage(stage, now)
            return self.status

    # --- internals -----------------------------------------------------------------------

    def _stage_done(self, stage: Stage, now: float) -> bool:
        s = self._status
        held = stage.hold_s is None or (s.stage_started_at is not None and now - s.stage_started_at >= stage.hold_s)
        counted = stage.min_requests is None or s.stage_requests >= stage.min_requests
        return held and counted and s.last_verdict == Verdict.PASS

    def _next_stage(self, stage: Stage, now: float) -> RolloutStatus:
        assert self._plan is not None
        s = self._status
        held = now - (s.stage_started_at or now)
        done = f"stage {stage.name!r} held {held:.0f}s with {s.stage_requests} spine requests, gates passing"
        index = s.stage_index + 1
        if index >= len(self._plan.stages):
            return self._move(State.PROMOTED, "promote", SYSTEM_ACTOR, done)
        following = self._plan.stages[index]
        if following.manual_approval:
            return self._move(State.AWAITING_APPROVAL, "await_approval", SYSTEM_ACTOR,
                              f"{done}; {following.name!r} needs manual approval")
        return self._enter(index, State.PROGRESSING, "advance", SYSTEM_ACTOR, done)

    def _enter(self, index: int, state: State, action: str, actor: str, reason: str,
               **changes: Any) -> RolloutStatus:
        assert self._plan is not None
        stage = self._plan.stages[index]
        return self._move(state, action, actor, reason, apply=(stage.spine_weight, stage.placements),
                          stage_index=index, consecutive_failures=0, stage_started_at=None,
                          window_started_at=None, stage_requests=0, last_verdict="",
                          paused_at=None, resume_state="", **changes)

    def _roll_back(self, state: State, action: str, actor: str, reason: str) -> RolloutStatus:
        index = self._status.stage_index
        placements = self._plan.stages[index - 1].placements if self._plan and index > 0 else all_remote()
        return self._move(state, action, actor, reason, apply=(0.0, placements),
                          paused_at=None, resume_state="")

    def _settle_rollback(self) -> RolloutStatus:
        s = self._status
        if s.state is State.ROLLING_BACK and self._target.applied(s.version):
            return self._move(State.ROLLED_BACK, "rolled_back", SYSTEM_ACTOR,
                              f"data planes acknowledged version {s.version}", acked=True)
        return self.status

    def _move(self, state: State, action: str, actor: str, reason: str, *,
              apply: tuple[float, dict[str, str]] | None = None, **changes: Any) -> RolloutStatus:
        """One transition: apply to the data path, then persist status + audit atomically."""
        before = self._status
        now = self._clock()
        new = replace(before, state=state, updated_at=now, **changes)
        if apply is not None:
            weight, placements = apply
            generation = before.generation + 1
            version = f"{new.plan_name}#{generation}"
            self._target.apply(weight, dict(placements), version)
            new = replace(new, generation=generation, version=version, spine_weight=weight,
                          placements=dict(placements), acked=False)
        stage = self._plan.stages[new.stage_index].name if self._plan else ""
        self._store.save(new, audit=(actor or "unknown", action, str(before.state), stage, reason))
        self._status = new
        self._cond.notify_all()
        return self.status

    def _save(self, *, gates: list[tuple[GateResult, str, float, float]] | None = None,
              **changes: Any) -> RolloutStatus:
        """Persist bookkeeping that is not a transition (no audit row)."""
        new = replace(self._status, **changes)
        self._store.save(new, gates=gates or ())
        self._status = new
        return new

    def _recover(self) -> None:
        with self._cond:
            s = self._status
            if s.state is State.PENDING or self._plan is None:
                return
            self._move(s.state, "recover", SYSTEM_ACTOR,
                       f"controller restarted; re-applied {s.spine_weight:g}% spine at stage "
                       f"{self._plan.stages[s.stage_index].name!r}, hold continues from the stage start",
                       apply=(s.spine_weight, s.placements), window_started_at=None, last_verdict="")

    def _stage(self) -> Stage | None:
        if self._plan is None or self._status.state is State.PENDING:
            return None
        return self._plan.stages[self._status.stage_index]

    def _busy(self, what: str) -> str:
        s = self._status
        return (f"{what}: plan {s.plan_name!r} is {s.state} at stage {s.stage_index + 1}; "
                "abort it (or wait for it to finish) first")

    def _hint(self) -> str:
        return {
            State.PENDING: " (start a plan first)",
            State.ROLLED_BACK: " (resume retries the stage; start begins a new rollout)",
            State.ABORTED: " (start a plan to begin again)",
            State.PROMOTED: " (the plan is complete)",
            State.ROLLING_BACK: " (wait for the rollback to finish)",
            State.PAUSED: " (resume it first)",
        }.get(self._status.state, "")


def _failure_reason(results: list[GateResult], failures: int, limit: int) -> str:
    failed = "; ".join(f"{r.gate}: {r.message}" for r in results if r.verdict is Verdict.FAIL and not r.dry_run)
    return f"gates failed {failures} consecutive window(s) (failure_limit {limit}): {failed}"
