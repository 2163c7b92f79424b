"""The migration state machine: operator commands plus a tick that reconciles the plan.

States: pending → progressing ⇄ paused, progressing → awaiting_approval → progressing,
the last stage → promoted; any live state → rolling_back → rolled_back (→ resume retries
the stage that failed); abort = rollback + terminal.

Which action is legal in which state, where it leads and what it does is ONE table,
`migration.transitions.TRANSITIONS`; every command and every tick goes through it
(`_step` to look up, `_perform` to carry out), so the rules cannot drift apart per command.
Rules the table encodes:
- Idempotent: a command whose effect already holds (pause while paused, rollback while
  rolled back) has effect NONE: it succeeds and records nothing. Argument-level retries
  (advance/approve naming the stage already current) are no-ops too.
- A pair absent from the table raises InvalidTransition and changes nothing.
- Paused means paused: a tick in `paused` does nothing (no window, no gate row, no
  automatic rollback); resume returns to the paused-from state with a fresh window.
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

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from migration.gates import GateResult, Verdict, evaluate, window_verdict
from migration.judge.score import judge_gates
from migration.lease import LeadershipView
from migration.legacy_endpoint import from_side
from migration.plan import Plan, Stage, refuse_other_legacy, refuse_parity_without_shadow
from migration.state_store import Store
from migration.status import AuditEntry, GateRecord, RolloutStatus, State, TransitionEvent
from migration.target import TrafficTarget, legacy_of
from migration.transition_executor import SYSTEM_ACTOR, TransitionExecutor
from migration.transitions import HINTS, Action, Effect, InvalidTransition
from services.common import Clock

__all__ = ["SYSTEM_ACTOR", "Controller", "InvalidTransition", "StatusView"]


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
    min_data_planes: int = 0  # how many must ACK a stage before it counts as applied
    followers: tuple[dict[str, Any], ...] = ()  # spine replicas and rate limiters following the stage
    min_spine_replicas: int = 0  # how many spine replicas must ACK a stage before it counts as applied
    leadership: LeadershipView | None = None  # with several replicas on one store: who leads


class Controller(TransitionExecutor):
    """One rollout's state machine over a sqlite store and a traffic target.

    Every public method takes the (reentrant) lock, so the gRPC service's commands and the
    runner's tick thread never interleave a transition: the table decides on the state the
    transition will actually be applied to. How a transition is carried out (apply, then
    persist with its audit row) is `TransitionExecutor`'s.
    """

    @classmethod
    def open(cls, db_path: str, target: TrafficTarget, *, clock: Clock = time.time,
             recover: bool = True) -> Controller:
        """Open (or create) the store (a sqlite path or a PostgreSQL DSN) and re-apply whatever
        stage it records (see module doc); with `recover=False` (a replica that may not lead)
        only read it: `take_lead` re-applies once it leads."""
        controller = cls(Store.open(db_path), target, clock=clock)
        if recover:
            controller._recover()
        return controller

    # Set by a replica that elects a leader (`migration.server`): who leads, for the view.
    leadership: Callable[[], LeadershipView] | None = None

    def report_leadership(self, view: Callable[[], LeadershipView]) -> None:
        """Show who leads in every status (`view` is the elector's answer): a replica that
        elects a leader is made after its controller, so it hands this over once it exists."""
        self.leadership = view

    def take_lead(self, why: str, fence: tuple[str, int] | None = None) -> None:
        """This replica leads now (`why` says since when, for the audit row): write as
        `fence` (holder, lease epoch) from now on, start from the store's last record and
        re-apply its stage, as a restart does (the hold continues, the window starts again).
        All under the lock: no command runs between taking the epoch and reading the record,
        so none acts on a status older than the last one the previous leader wrote."""
        with self._cond:
            if fence is not None:
                self._store.fence_with(*fence)
            self.refresh()
            self._recover(why)

    def close(self) -> None:
        self._store.close()

    def on_transition(self, listener: Callable[[TransitionEvent], None]) -> None:
        """Call `listener` after every committed transition, under the controller's lock: it
        must only hand the event on (a webhook queue), never wait on anything."""
        with self._cond:
            self._listeners.append(listener)

    # --- reading -------------------------------------------------------------------------

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
            followers = getattr(self._target, "followers", None)
            return StatusView(status, self._plan, stage, awaiting, max(0.0, elapsed), last,
                              self._store.recent_audit(audit_rows), tuple(planes() if planes else ()),
                              int(getattr(self._target, "min_data_planes", 0)),
                              tuple(followers() if followers else ()),
                              int(getattr(self._target, "min_spine_replicas", 0)),
                              self.leadership() if self.leadership is not None else None)

    def wait_for_audit(self, after_id: int, timeout: float) -> list[AuditEntry]:
        """Audit rows after `after_id`, waiting up to `timeout` s for one to appear."""
        with self._cond:
            rows = self._store.audit(after_id)
            if not rows:
                self._cond.wait(timeout)
                rows = self._store.audit(after_id)
            return rows

    def wake_watchers(self) -> None:
        """Wake every `wait_for_audit` now (a server that stops ends its streams at once)."""
        with self._cond:
            self._cond.notify_all()

    # --- commands ------------------------------------------------------------------------
    # Each command asks the table (`_step`/`_perform`) what its action does in the current
    # state; the only checks left here are about its ARGUMENTS (see migration/transitions.py).

    def check_plan(self, plan: Plan) -> None:
        """Refuse (PlanError) what this data path cannot judge: a parity gate where nothing
        mirrors traffic (the target says, `TrafficTarget.shadow`), and a plan written for
        another from side than the data path's (`legacy:`, `migration.legacy_endpoint`)."""
        refuse_other_legacy(plan, legacy_of(self._target))
        if plan.parity_gates():
            shadow = self._target.shadow()
            if not shadow.enabled:
                refuse_parity_without_shadow(plan, shadow.detail)

    def load(self, plan: Plan, actor: str, reason: str = "") -> RolloutStatus:
        """Make `plan` the pending plan (only while nothing is in flight)."""
        with self._cond:
            self._step(Action.LOAD)
            self.check_plan(plan)
            s = self._status
            if s.state is State.PENDING and s.plan_yaml == plan.source:
                return self.status  # that plan is already the pending one
            return self._with_plan(plan, lambda: self._perform(
                Action.LOAD, actor, reason or f"loaded plan {plan.name!r}",
                plan_name=plan.name, plan_yaml=plan.source, stage_index=0))

    def start(self, plan: Plan | None, actor: str, reason: str = "") -> RolloutStatus:
        """Begin the plan (or the loaded one) at its first stage."""
        with self._cond:
            step = self._step(Action.START)
            chosen = plan or self._plan
            if chosen is None:
                raise InvalidTransition("no plan to start: load one with Plan (spine migrate plan FILE) "
                                        "or pass it to Start")
            s = self._status
            if step.effect is Effect.NONE:  # a retried start: only of the plan already running
                if chosen.source != s.plan_yaml:
                    raise InvalidTransition(
                        f"cannot start plan {chosen.name!r}: plan {s.plan_name!r} is {s.state} at stage "
                        f"{s.stage_index + 1}; abort it (or wait for it to finish) first")
                return self.status
            self.check_plan(chosen)
            return self._with_plan(chosen, lambda: self._perform(
                Action.START, actor, reason or f"start plan {chosen.name!r}", index=0,
                plan_name=chosen.name, plan_yaml=chosen.source))

    def advance(self, stage: str | None, actor: str, reason: str = "") -> RolloutStatus:
        """Skip to `stage` (default: the next one) now, ignoring hold and gates."""
        with self._cond:
            self._step(Action.ADVANCE)
            s, plan = self._status, self._loaded()
            index = s.stage_index + 1
            if stage is not None:
                found = plan.stage_index(stage)
                if found is None:
                    names = ", ".join(st.name for st in plan.stages)
                    raise InvalidTransition(f"unknown stage {stage!r}; plan {plan.name!r} has: {names}")
                if found < s.stage_index:
                    raise InvalidTransition(f"stage {stage!r} is behind the current stage "
                                            f"{plan.stages[s.stage_index].name!r}; use rollback to go back")
                if found == s.stage_index:
                    return self.status  # a retried advance that already took effect
                index = found
            reason = reason or "advanced by operator"
            if index >= len(plan.stages):
                return self._perform(Action.PROMOTE, actor, reason)
            return self._perform(Action.ADVANCE, actor, reason, index=index)

    def pause(self, actor: str, reason: str = "") -> RolloutStatus:
        """Stop judging and advancing (tick does nothing); the stage's weights stay as they are."""
        with self._cond:
            return self._perform(Action.PAUSE, actor, reason)

    def resume(self, actor: str, reason: str = "") -> RolloutStatus:
        """Continue a paused rollout; after a rollback, retry the stage that rolled back."""
        with self._cond:
            if self._step(Action.RESUME).effect is Effect.ENTER:
                reason = reason or "retry the stage that rolled back"
            return self._perform(Action.RESUME, actor, reason, index=self._status.stage_index)

    def approve(self, stage: str | None, actor: str, reason: str = "") -> RolloutStatus:
        """Let the rollout enter the stage that waits for manual approval."""
        with self._cond:
            step = self._step(Action.APPROVE)
            s, plan = self._status, self._loaded()
            if step.effect is Effect.NONE:
                # Nothing awaits: only a retried approval, naming the stage it let in, succeeds.
                if stage is not None and stage == plan.stages[s.stage_index].name:
                    return self.status
                hint = HINTS.get(s.state, "")
                raise InvalidTransition(f"nothing awaits approval: cannot approve while the rollout is "
                                        f"{s.state}{self._where()}" + (f"; {hint}" if hint else ""))
            awaited = plan.stages[s.stage_index + 1].name
            if stage is not None and stage != awaited:
                raise InvalidTransition(f"stage {stage!r} is not awaiting approval; {awaited!r} is")
            return self._perform(Action.APPROVE, actor, reason or f"approved entering {awaited!r}",
                                 index=s.stage_index + 1)

    def rollback(self, actor: str, reason: str = "") -> RolloutStatus:
        """All traffic to the layered side, the spine's placements to the previous stage's."""
        with self._cond:
            return self._perform(Action.ROLLBACK, actor, reason or "rolled back by operator")

    def abort(self, actor: str, reason: str = "") -> RolloutStatus:
        """Roll back and stop for good: only a new `load` or `start` leaves the aborted state."""
        with self._cond:
            return self._perform(Action.ABORT, actor, reason or "aborted by operator")

    # --- reconciling ---------------------------------------------------------------------

    def tick(self, now: float | None = None) -> RolloutStatus:
        """One reconcile step: ACKs, window evaluation, automatic advance or rollback.

        What a tick may do is the table's (state, tick) entry: judge and advance while
        progressing, judge only while awaiting approval, finish a rollback once ACKed, once
        finished only note when what was published last is ACKed (an abort, a re-apply after
        a restart: the status stops saying "waiting for ACK"), and nothing at all in any other
        state (paused included: no window, no gate row).
        """
        with self._cond:
            now = self._clock() if now is None else now
            step = self._step(Action.TICK)
            if step.effect is Effect.SETTLE:
                return self._settle_rollback()
            if step.effect is Effect.NOTE_ACK:
                s = self._status
                if s.version and not s.acked and self._target.applied(s.version):
                    self._save(acked=True, updated_at=now)
                return self.status
            stage, plan = self._stage(), self._plan
            if step.effect not in (Effect.WATCH, Effect.PROGRESS) or stage is None or plan is None:
                return self.status
            s = self._status
            if not s.acked:
                if not self._target.applied(s.version):
                    return self.status
                started = s.stage_started_at if s.stage_started_at is not None else now
                s = self._save(acked=True, stage_started_at=started, window_started_at=now, updated_at=now)
            start = s.window_started_at if s.window_started_at is not None else now
            if now - start >= plan.window_s:
                layered, spine, parity = self._target.window_stats(since=start)
                results = evaluate(stage.gates, layered, spine, parity, plan.min_window_requests,
                                   from_side(plan.legacy))
                if stage.judge is not None:  # marginal or cannot tell: inconclusive, the stage holds
                    results += judge_gates(stage.judge, layered, spine, parity)
                verdict = window_verdict(results)
                failures = {Verdict.FAIL: s.consecutive_failures + 1, Verdict.PASS: 0}.get(
                    verdict, s.consecutive_failures)
                s = self._save(window_started_at=now, stage_requests=s.stage_requests + spine.requests,
                               last_verdict=str(verdict), consecutive_failures=failures, updated_at=now,
                               gates=[(r, stage.name, start, now) for r in results])
                if verdict is Verdict.FAIL and failures >= stage.failure_limit:
                    return self._perform(Action.ROLLBACK, SYSTEM_ACTOR,
                                         _failure_reason(results, failures, stage.failure_limit))
            if step.effect is Effect.PROGRESS and self._stage_done(stage, now):
                return self._next_stage(stage, now)
            return self.status

    # --- internals -----------------------------------------------------------------------

    def _stage_done(self, stage: Stage, now: float) -> bool:
        s = self._status
        held = stage.hold_s is None or (s.stage_started_at is not None and now - s.stage_started_at >= stage.hold_s)
        counted = stage.min_requests is None or s.stage_requests >= stage.min_requests
        return held and counted and s.last_verdict == Verdict.PASS

    def _next_stage(self, stage: Stage, now: float) -> RolloutStatus:
        plan, s = self._loaded(), self._status
        held = now - (s.stage_started_at or now)
        done = f"stage {stage.name!r} held {held:.0f}s with {s.stage_requests} spine requests, gates passing"
        judged = [r for r in self._latest_gates(stage.name) if r.gate == "judge" and r.value is not None]
        if judged:  # the audit row keeps the score the stage advanced on
            done += f", judge score {judged[0].value:.1f}" + (" (dry run)" if judged[0].dry_run else "")
        index = s.stage_index + 1
        if index >= len(plan.stages):
            return self._perform(Action.PROMOTE, SYSTEM_ACTOR, done)
        following = plan.stages[index]
        if following.manual_approval:
            return self._perform(Action.AWAIT_APPROVAL, SYSTEM_ACTOR,
                                 f"{done}; {following.name!r} needs manual approval")
        return self._perform(Action.ADVANCE, SYSTEM_ACTOR, done, index=index)

    def _recover(self, why: str = "controller restarted") -> None:
        with self._cond:
            s = self._status
            if self._step(Action.RECOVER).effect is Effect.NONE or self._plan is None:
                return
            self._perform(Action.RECOVER, SYSTEM_ACTOR,
                          f"{why}; re-applied {s.spine_weight:g}% spine at stage "
                          f"{self._plan.stages[s.stage_index].name!r}, hold continues from the stage start")

def _failure_reason(results: list[GateResult], failures: int, limit: int) -> str:
    failed = "; ".join(f"{r.gate}: {r.message}" for r in results if r.verdict is Verdict.FAIL and r.counts and not r.dry_run)
    return f"gates failed {failures} consecutive window(s) (failure_limit {limit}): {failed}"
