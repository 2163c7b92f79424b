"""Carrying out one transition of the rollout: apply it to the data path, then persist it.

`Controller` (`controller.py`) decides which action to take (an operator's command, a
tick's verdict); the table (`migration.transitions`) says what that action does in the
current state; this carries it out: the data path is told first (`target.apply`), then the
new status is persisted with its audit row in one transaction, and listeners hear of it.
A failed apply changes nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from migration.gates import GateResult
from migration.plan import Plan, Stage, load_plan
from migration.state_store import Store
from migration.status import GateRecord, RolloutStatus, State, TransitionEvent, all_remote
from migration.target import TrafficTarget
from migration.transitions import Action, Effect, Transition, transition
from services.common import Clock

SYSTEM_ACTOR = "controller"
log = logging.getLogger("spine.migration")


class TransitionExecutor:
    """The rollout's status, plan and store, and the one way a transition changes them."""

    def __init__(self, store: Store, target: TrafficTarget, *, clock: Clock = time.time) -> None:
        self._store = store
        self._target = target
        self._clock = clock
        self._cond = threading.Condition(threading.RLock())
        self._status = store.load() or RolloutStatus(updated_at=clock())
        self._plan = load_plan(self._status.plan_yaml) if self._status.plan_yaml else None
        self._listeners: list[Callable[[TransitionEvent], None]] = []

    @property
    def status(self) -> RolloutStatus:
        with self._cond:
            return replace(self._status, placements=dict(self._status.placements))

    def refresh(self) -> None:
        """Read the status (and its plan) again from the store: a replica that does not lead
        follows the leader's writes this way, and a new leader starts from the last of them."""
        with self._cond:
            status = self._store.load()
            if status is None or status == self._status:
                return
            if status.plan_yaml != self._status.plan_yaml:
                self._plan = load_plan(status.plan_yaml) if status.plan_yaml else None
            self._status = status
            self._cond.notify_all()

    def _step(self, action: Action) -> Transition:
        """The table's entry for `action` now; refuses (changing nothing) when there is none."""
        return transition(self._status.state, action, self._where())

    def _perform(self, action: Action, actor: str, reason: str, *, index: int | None = None,
                 **changes: Any) -> RolloutStatus:
        """Carry out the table's entry for `action` in the current state.

        `index` is the stage an ENTER effect applies (the command resolved it from its
        arguments); `changes` are extra status fields the transition persists with it.
        """
        with self._cond:  # reentrant: commands already hold it; a test walking the table may not
            step = self._step(action)
            s = self._status
            state = step.next if step.next is not None else State(s.resume_state or State.PROGRESSING)
            record = step.record_as or str(action)
            match step.effect:
                case Effect.NONE:
                    return self.status
                case Effect.RECORD:
                    return self._move(state, record, actor, reason, **changes)
                case Effect.ENTER:
                    assert index is not None, f"{action} enters a stage: the command must name it"
                    return self._enter(index, state, record, actor, reason, **changes)
                case Effect.PAUSE:
                    return self._move(state, record, actor, reason, paused_at=self._clock(),
                                      resume_state=str(s.state))
                case Effect.RESUME:
                    now = self._clock()
                    paused_for = now - (s.paused_at if s.paused_at is not None else now)
                    started = s.stage_started_at + paused_for if s.stage_started_at is not None else None
                    # The hold does not count paused time; the window in progress is discarded.
                    return self._move(state, record, actor, reason, stage_started_at=started,
                                      window_started_at=now if s.acked else None, last_verdict="")
                case Effect.ROLL_BACK:
                    placements = (self._plan.stages[s.stage_index - 1].placements
                                  if self._plan and s.stage_index > 0 else all_remote())
                    self._move(state, record, actor, reason, apply=(0.0, placements))
                    # The built-in front applies weight 0 at once (it waits for no spine, not even a
                    # spine process that is gone): finish the rollback in the same call.
                    return self._settle_rollback() if state is State.ROLLING_BACK else self.status
                case Effect.REAPPLY:
                    return self._move(state, record, actor, reason, apply=(s.spine_weight, s.placements),
                                      window_started_at=None, last_verdict="")
            raise AssertionError(f"{action} in {s.state}: {step.effect} is tick's work, not a transition")

    def _with_plan(self, plan: Plan, do: Callable[[], RolloutStatus]) -> RolloutStatus:
        """Run `do` with `plan` as the controller's plan; put the old one back if it fails."""
        previous = self._plan
        self._plan = plan
        try:
            return do()
        except BaseException:
            self._plan = previous
            raise

    def _enter(self, index: int, state: State, action: str, actor: str, reason: str,
               **changes: Any) -> RolloutStatus:
        stage = self._loaded().stages[index]
        return self._move(state, action, actor, reason, apply=(stage.spine_weight, stage.placements),
                          stage_index=index, consecutive_failures=0, stage_started_at=None,
                          window_started_at=None, stage_requests=0, last_verdict="", **changes)

    def _settle_rollback(self) -> RolloutStatus:
        """Take `rolled_back` once the data planes ACK the rollback version (else wait)."""
        s = self._status
        if self._target.applied(s.version):
            return self._perform(Action.ROLLED_BACK, SYSTEM_ACTOR,
                                 f"data planes acknowledged version {s.version}", acked=True)
        return self.status

    def _move(self, state: State, action: str, actor: str, reason: str, *,
              apply: tuple[float, dict[str, str]] | None = None, **changes: Any) -> RolloutStatus:
        """One transition: apply to the data path, then persist status + audit atomically.

        Leaving `paused` always clears the pause bookkeeping, whichever command leaves it, so
        a stale `paused_at` can never shift a later stage's hold.
        """
        before = self._status
        now = self._clock()
        if state is not State.PAUSED:
            changes = {"paused_at": None, "resume_state": "", **changes}
        new = replace(before, state=state, updated_at=now, **changes)
        if apply is not None:
            weight, placements = apply
            generation = before.generation + 1
            version = f"{new.plan_name}#{generation}"
            # Fenced (several replicas): nothing reaches the data path unless this one still leads.
            self._store.check_fence()
            # Every apply carries the plan's route_header: rollback and abort keep the running
            # plan's (the plan stays loaded), and a restart re-reads it from the persisted plan.
            self._target.apply(weight, dict(placements), version, route_header=self._loaded().route_header)
            new = replace(new, generation=generation, version=version, spine_weight=weight,
                          placements=dict(placements), acked=False)
        stage = self._plan.stages[new.stage_index].name if self._plan else ""
        audit_id = self._store.save(new, audit=(actor or "unknown", action, str(before.state), stage, reason))
        self._status = new
        self._cond.notify_all()
        if self._listeners:
            self._tell(TransitionEvent(audit_id or 0, now, new.plan_name, stage, action, actor or "unknown",
                                       str(before.state), str(state), reason, new.spine_weight, new.version,
                                       self._latest_gates(stage)))
        return self.status

    def _tell(self, event: TransitionEvent) -> None:
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:  # a broken listener must not undo or stop a committed transition
                log.exception("transition listener %r failed", listener)

    def _latest_gates(self, stage: str) -> tuple[GateRecord, ...]:
        """`stage`'s latest judged window's gate results (empty when none was judged)."""
        history = [r for r in self._store.gate_history(50) if r.stage == stage]
        return tuple(r for r in history if r.window_end == history[-1].window_end) if history else ()

    def _save(self, *, gates: list[tuple[GateResult, str, float, float]] | None = None,
              **changes: Any) -> RolloutStatus:
        """Persist bookkeeping that is not a transition (no audit row)."""
        new = replace(self._status, **changes)
        self._store.save(new, gates=gates or ())
        self._status = new
        return new

    def _loaded(self) -> Plan:
        """The plan, in a state the table only allows once one is loaded."""
        assert self._plan is not None, f"no plan in state {self._status.state}"
        return self._plan

    def _stage(self) -> Stage | None:
        if self._plan is None or self._status.state is State.PENDING:
            return None
        return self._plan.stages[self._status.stage_index]

    def _where(self) -> str:
        """Where the rollout stands, for refusal messages (empty before a rollout starts)."""
        s = self._status
        if self._plan is None or s.state is State.PENDING:
            return ""
        return f" at stage {self._plan.stages[s.stage_index].name!r} of plan {s.plan_name!r}"


