"""`spine migrate status --watch`: the status view, redrawn as the controller moves.

Like `kubectl argo rollouts get rollout --watch`: one screen (stage, weights, placements, the
last window's gates with value against threshold, data planes, the latest audit rows) that
rich's live display redraws on every event of the controller's WatchEvents stream — at
once on a transition, and at least every second otherwise (the stream's heartbeat carries
a fresh status, so the hold clock moves). It ends when the rollout does, with the final
state's exit code: 0 promoted, 1 rolled back or aborted. Ctrl-C detaches (exit 0); the
rollout goes on.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from migration.render import status_renderable, to_json
from wire.v1 import migration_pb2 as pb

FINAL_STATES = ("promoted", "rolled_back", "aborted")
STREAM_ENDED = 4  # as the CLI's "controller unreachable"


def exit_code(state: str) -> int:
    """0 for a promoted rollout, 1 for one rolled back or aborted."""
    return 0 if state == "promoted" else 1


def watch_renderable(status: pb.RolloutStatus, address: str) -> Group:
    final = status.state in FINAL_STATES
    line = (f"finished: {status.state}" if final
            else f"watching {address}; redrawn on every transition (Ctrl-C detaches, the rollout goes on)")
    stamp = time.strftime("%H:%M:%S")
    return Group(Text(f"{stamp}  {line}", style="bold" if final else "dim"), status_renderable(status))


def follow(events: Iterable[pb.MigrationEvent], show: Callable[[pb.MigrationEvent], None], address: str) -> int:
    """`show` each event until the rollout finishes: the final state's exit code; 0 when
    Ctrl-C detaches; STREAM_ENDED when the controller ends the stream first (it stops)."""
    state = ""
    try:
        for event in events:
            show(event)
            state = event.status.state
            if state in FINAL_STATES:
                break
    except KeyboardInterrupt:
        print("detached; the rollout goes on (spine migrate status)", file=sys.stderr)
        return 0
    finally:
        cancel: Any = getattr(events, "cancel", None)
        if cancel is not None:
            cancel()
    if state not in FINAL_STATES:
        print(f"the controller at {address} ended the stream while the rollout was {state or 'unknown'}",
              file=sys.stderr)
        return STREAM_ENDED
    return exit_code(state)


def print_json(event: pb.MigrationEvent) -> None:
    print(json.dumps(to_json(event)), flush=True)


def watch(events: Iterable[pb.MigrationEvent], console: Console, address: str, *, as_json: bool = False) -> int:
    """Draw each event's status until a final state (`follow`)."""
    if as_json:
        return follow(events, print_json, address)
    with Live(console=console, auto_refresh=False, redirect_stdout=False) as live:
        return follow(events, lambda event: live.update(watch_renderable(event.status, address), refresh=True),
                      address)
