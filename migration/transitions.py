"""The controller's transition table: every (state, action) the rollout accepts, in one place.

Why a table: when each command guarded itself with its own if-chain, the rules lived in
eight places and drifted (a command could be legal in a state no document mentioned). Here
one dict answers "what does ACTION do in STATE?" for every operator command AND for the
controller's own steps (tick, automatic promote, await_approval, rolled_back, recover), so a
test can walk every pair and a person can read the whole machine on one screen.

A pair that is absent is refused with `InvalidTransition`, which names the state, the action
and the commands the state does accept. Idempotence is in the table too: an entry whose
effect is `Effect.NONE` succeeds and changes and records nothing (pause while paused,
rollback while rolled back, a retried start of the running plan).

A command's ARGUMENTS can only narrow what the table allows, never widen it: a named stage
that does not exist, is behind, or is not the awaited one is refused; an advance to the stage
already current, a re-loaded plan already pending, or a retried approval naming the stage it
already let in is found to hold already (no-op). Those checks live in the command
(`Controller.advance`, `approve`, `start`, `load`) because they need the plan, not the state.
"""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple

from migration.status import State


class InvalidTransition(Exception):
    """The command makes no sense in the rollout's current state; nothing was changed."""


class Action(StrEnum):
    # Operator commands (the CLI's and the gRPC service's verbs).
    LOAD = "load"
    START = "start"
    ADVANCE = "advance"
    PAUSE = "pause"
    RESUME = "resume"
    APPROVE = "approve"
    ROLLBACK = "rollback"
    ABORT = "abort"
    # The controller's own steps. `promote` is also what an operator advance past the last
    # stage becomes; `rollback` doubles as the automatic rollback after failing gates.
    TICK = "tick"
    PROMOTE = "promote"
    AWAIT_APPROVAL = "await_approval"
    ROLLED_BACK = "rolled_back"
    RECOVER = "recover"


COMMANDS: tuple[Action, ...] = (Action.LOAD, Action.START, Action.ADVANCE, Action.PAUSE, Action.RESUME,
                                Action.APPROVE, Action.ROLLBACK, Action.ABORT)


class Effect(StrEnum):
    """What the controller does besides setting the next state.

    Every effect but NONE, WATCH, PROGRESS, SETTLE and NOTE_ACK is a transition: the data path is told
    first (for ENTER, ROLL_BACK, REAPPLY), then the status and ONE audit row are committed in
    one sqlite transaction. WATCH/PROGRESS/SETTLE/NOTE_ACK are tick's reconciling work: they persist
    bookkeeping (ACKs, gate windows) without an audit row, and any transition they decide on
    (advance, promote, await_approval, rollback, rolled_back) goes through the table again.
    """

    NONE = "none"            # what was asked already holds: change nothing, record nothing
    RECORD = "record"        # persist the new state + audit row; the data path is not touched
    ENTER = "enter"          # apply a stage's weight and placements; its hold starts at the ACK
    PAUSE = "pause"          # note when, and the state to return to; the hold stops counting
    RESUME = "resume"        # back to the paused-from state; the hold skips the paused time,
    #                          the window in progress is discarded
    ROLL_BACK = "roll_back"  # apply 0 % spine with the previous stage's placements
    REAPPLY = "reapply"      # after a restart: re-apply the persisted weights under a new version
    WATCH = "watch"          # tick: note the ACK, judge windows, roll back on failure_limit
    PROGRESS = "progress"    # tick: WATCH, then advance / await_approval / promote when the stage is done
    SETTLE = "settle"        # tick: once the rollback version is ACKed, take `rolled_back`
    NOTE_ACK = "note_ack"    # tick, once finished: note when the version published last (an abort,
    #                          a re-apply after a restart) is ACKed; nothing judged, no audit row


class Transition(NamedTuple):
    next: State | None  # None: back to the state the rollout was paused from (see `resume`)
    effect: Effect
    record_as: str = ""  # the audit row's action, when it is not the action's own name


_P, _G, _PA, _AW = State.PENDING, State.PROGRESSING, State.PAUSED, State.AWAITING_APPROVAL
_PR, _RB, _RD, _AB = State.PROMOTED, State.ROLLING_BACK, State.ROLLED_BACK, State.ABORTED
A, E = Action, Effect

TRANSITIONS: dict[tuple[State, Action], Transition] = {
    # pending: nothing applied yet.
    (_P, A.LOAD): Transition(_P, E.RECORD),
    (_P, A.START): Transition(_G, E.ENTER),
    (_P, A.TICK): Transition(_P, E.NONE),
    (_P, A.RECOVER): Transition(_P, E.NONE),  # nothing was ever applied, nothing to re-apply
    # progressing: a stage is live, its gates judged every window.
    (_G, A.START): Transition(_G, E.NONE),  # a retried start of the running plan
    (_G, A.ADVANCE): Transition(_G, E.ENTER),
    (_G, A.PROMOTE): Transition(_PR, E.RECORD),
    (_G, A.PAUSE): Transition(_PA, E.PAUSE),
    (_G, A.RESUME): Transition(_G, E.NONE),
    (_G, A.APPROVE): Transition(_G, E.NONE),  # a retried approval naming the stage it let in
    (_G, A.ROLLBACK): Transition(_RB, E.ROLL_BACK),
    (_G, A.ABORT): Transition(_AB, E.ROLL_BACK),
    (_G, A.TICK): Transition(_G, E.PROGRESS),
    (_G, A.AWAIT_APPROVAL): Transition(_AW, E.RECORD),
    (_G, A.RECOVER): Transition(_G, E.REAPPLY),
    # paused: weights stay, NOTHING is judged (no window, no gate row, no automatic rollback).
    (_PA, A.START): Transition(_PA, E.NONE),
    (_PA, A.ADVANCE): Transition(_G, E.ENTER),  # entering a stage ends the pause
    (_PA, A.PROMOTE): Transition(_PR, E.RECORD),
    (_PA, A.PAUSE): Transition(_PA, E.NONE),
    (_PA, A.RESUME): Transition(None, E.RESUME),
    (_PA, A.APPROVE): Transition(_PA, E.NONE),  # a retried approval; a new one needs resume first
    (_PA, A.ROLLBACK): Transition(_RB, E.ROLL_BACK),
    (_PA, A.ABORT): Transition(_AB, E.ROLL_BACK),
    (_PA, A.TICK): Transition(_PA, E.NONE),
    (_PA, A.RECOVER): Transition(_PA, E.REAPPLY),
    # awaiting_approval: the stage before stays live and watched; the next waits for a person.
    (_AW, A.START): Transition(_AW, E.NONE),
    (_AW, A.ADVANCE): Transition(_G, E.ENTER),
    (_AW, A.PAUSE): Transition(_PA, E.PAUSE),
    (_AW, A.RESUME): Transition(_AW, E.NONE),
    (_AW, A.APPROVE): Transition(_G, E.ENTER),
    (_AW, A.ROLLBACK): Transition(_RB, E.ROLL_BACK),
    (_AW, A.ABORT): Transition(_AB, E.ROLL_BACK),
    (_AW, A.TICK): Transition(_AW, E.WATCH),
    (_AW, A.RECOVER): Transition(_AW, E.REAPPLY),
    # promoted: the plan is complete; the last stage's weights stay.
    (_PR, A.LOAD): Transition(_P, E.RECORD),
    (_PR, A.START): Transition(_G, E.ENTER),
    (_PR, A.ROLLBACK): Transition(_RB, E.ROLL_BACK),
    (_PR, A.ABORT): Transition(_AB, E.ROLL_BACK),
    (_PR, A.TICK): Transition(_PR, E.NOTE_ACK),
    (_PR, A.RECOVER): Transition(_PR, E.REAPPLY),
    # rolling_back: the layered weights are applied, waiting for the data planes' ACK.
    (_RB, A.ROLLBACK): Transition(_RB, E.NONE),
    (_RB, A.ABORT): Transition(_AB, E.RECORD),  # the rollback is already applied
    (_RB, A.TICK): Transition(_RB, E.SETTLE),
    (_RB, A.ROLLED_BACK): Transition(_RD, E.RECORD),
    (_RB, A.RECOVER): Transition(_RB, E.REAPPLY),
    # rolled_back: all traffic on layered; resume retries the stage that failed.
    (_RD, A.LOAD): Transition(_P, E.RECORD),
    (_RD, A.START): Transition(_G, E.ENTER),
    (_RD, A.RESUME): Transition(_G, E.ENTER, record_as="retry"),
    (_RD, A.ROLLBACK): Transition(_RD, E.NONE),
    (_RD, A.ABORT): Transition(_AB, E.RECORD),
    (_RD, A.TICK): Transition(_RD, E.NOTE_ACK),
    (_RD, A.RECOVER): Transition(_RD, E.REAPPLY),
    # aborted: terminal until a new load or start.
    (_AB, A.LOAD): Transition(_P, E.RECORD),
    (_AB, A.START): Transition(_G, E.ENTER),
    (_AB, A.ROLLBACK): Transition(_AB, E.NONE),
    (_AB, A.ABORT): Transition(_AB, E.NONE),
    (_AB, A.TICK): Transition(_AB, E.NOTE_ACK),
    (_AB, A.RECOVER): Transition(_AB, E.REAPPLY),
}
del A, E

# What a refusal says first, where a bare "cannot X" would read oddly.
_LEADS = {Action.APPROVE: "nothing awaits approval", Action.ROLLBACK: "nothing to roll back",
          Action.ABORT: "nothing to abort"}
# What to do next, per state, appended to a refusal.
HINTS = {
    State.PENDING: "start a plan first",
    State.PAUSED: "resume it first",
    State.PROMOTED: "the plan is complete",
    State.ROLLING_BACK: "wait for the rollback to finish, or abort",
    State.ROLLED_BACK: "resume retries the stage; start begins a new rollout",
    State.ABORTED: "start a plan to begin again",
}


def accepted(state: State) -> list[Action]:
    """The operator commands `state` accepts (no-ops included), in COMMANDS order."""
    return [action for action in COMMANDS if (state, action) in TRANSITIONS]


def transition(state: State, action: Action, where: str = "") -> Transition:
    """The table's entry for (state, action), or InvalidTransition naming what IS accepted.

    `where` (e.g. " at stage 'logs' of plan 'three'") is woven into the refusal so the
    person reading it sees the position without running `status`.
    """
    step = TRANSITIONS.get((state, action))
    if step is not None:
        return step
    lead = _LEADS.get(action, "")
    if action in (Action.LOAD, Action.START):  # refused only while a rollout is in flight
        hint = "abort it or wait for it to finish first"
    else:
        hint = HINTS.get(state, "")
    moving = [a for a in accepted(state) if TRANSITIONS[state, a].effect is not Effect.NONE]
    retries = [a for a in accepted(state) if TRANSITIONS[state, a].effect is Effect.NONE]
    commands = ", ".join(moving) + (f" (and, as no-op retries, {', '.join(retries)})" if retries else "")
    raise InvalidTransition(f"{lead + ': ' if lead else ''}cannot {action} while the rollout is {state}{where}; "
                            f"{state} accepts {commands}" + (f"; {hint}" if hint else ""))


def table_text() -> str:
    """The table as aligned text (for docs and reports): state, action, next state, effect."""
    lines = []
    for (state, action), step in TRANSITIONS.items():
        after = step.next or "(paused-from state)"
        note = f"  [recorded as {step.record_as!r}]" if step.record_as else ""
        lines.append(f"{state:<18} {action:<15} -> {after:<20} {step.effect}{note}")
    return "\n".join(lines)
