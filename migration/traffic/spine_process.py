"""The spine as a process of its own: `spine up --layout mixed`, following the controller's
stages over ADS, its faults switched through its stdin.

Why: in the demo's process the spine's gateway, middlewares and model shared one
interpreter with the front, the controller, the xDS server and the traffic's bookkeeping,
while the layered side had processes of its own; `make run`'s tables then compared a spine
slowed by the harness with a layered stack that was not (the spine read slower at every
stage, for that reason alone). Here both sides are what they are in production.

- It starts on the demo's placements (the model local, every middleware remote, in the
  layered stack's processes: `remote_addresses`) and then follows the controller's stages
  over ADS like any replica (`runtime.stage_follower`): placements moved live and its
  share of every limit, each stage ACKed once applied (`FrontTarget.applied` waits for it).
- `--inject-fault switchable`: the demo's faults (half the model's calls failing, wrong
  answers) are switched by lines on its stdin, a pipe only this process holds
  (`runtime.faults.FaultSwitch`); each switch waits for the child's answer.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from migration.traffic.layout_process import LayoutProcess
from runtime.config.model import SpineConfig
from services.registry import MIDDLEWARES

SWITCH_TIMEOUT_S = 5.0


class FaultNotSwitched(RuntimeError):
    """The spine process refused a fault switch or did not answer it in time."""


class FaultSwitchedProcess(LayoutProcess):
    """A `spine up --inject-fault switchable` child: its faults switched by lines on its stdin."""

    def __init__(self, config: SpineConfig, run_dir: Path) -> None:
        super().__init__(config, run_dir)
        self._switching = threading.Lock()

    def switch_fault(self, command: str) -> dict[str, Any]:
        """Send one `FaultSwitch` command and return the child's answer to it (the fault now)."""
        with self._switching:  # one command in flight: its answer is the next one that names it
            launched = self.launched
            if launched is None or not launched.alive():
                raise FaultNotSwitched(f"{command!r}: the spine process is not running")
            try:
                launched.send(command)
            except (OSError, ValueError) as error:  # it exited (a broken pipe), or is being stopped
                raise FaultNotSwitched(f"{command!r}: the spine process is not reading ({error}); "
                                       f"see {self.log_path}") from None
            # an earlier command's late answer is dropped
            answer = launched.wait_for(partial(_fault_answer, command.strip()), SWITCH_TIMEOUT_S)
        if answer is None:
            raise FaultNotSwitched(f"{command!r}: no answer from the spine process within "
                                   f"{SWITCH_TIMEOUT_S:g}s; see {self.log_path}")
        if answer.get("event") != "fault":
            raise FaultNotSwitched(f"{command!r}: refused by the spine process: {answer.get('why', answer)}")
        return answer

    def _stdin(self) -> bool:
        return True


class SpineProcess(FaultSwitchedProcess):
    """A spine replica in its own process, following the xDS control plane at `controller`."""

    name = "spine"
    layout = "mixed"

    def __init__(self, config: SpineConfig, run_dir: Path, *, controller: str,
                 remote: Mapping[str, str], node_id: str = "demo-spine") -> None:
        placed = {"placements": {"inference": "local", **dict.fromkeys(MIDDLEWARES, "remote")},
                  "remote_addresses": dict(remote)}
        super().__init__(config.with_overrides(placed), run_dir)
        self.controller = controller
        self.node_id = node_id

    def up_arguments(self) -> Sequence[str]:
        # No wait for a first stage: until the controller publishes one, the config's placements.
        return ("--follow-controller", self.controller, "--node-id", self.node_id,
                "--initial-fetch-timeout-s", "0", "--inject-fault", "switchable")


class CollapsedSpineProcess(FaultSwitchedProcess):
    """The whole spine in one process (`spine up --layout collapsed`), its faults switchable:
    the "to" side of a migration from a foreign legacy endpoint (`legacy_cutover`), where
    there is no layered stack to share middlewares with and no stage to follow."""

    name = "spine"
    layout = "collapsed"

    def up_arguments(self) -> Sequence[str]:
        return ("--inject-fault", "switchable")


def _fault_answer(command: str, line: str) -> dict[str, Any] | None:
    """The answer to `command` a line holds, one JSON object (found in its line even when
    something else printed on it first)."""
    at = line.find('{"event": "fault')
    if at < 0:
        return None
    try:
        event, _ = json.JSONDecoder().raw_decode(line, at)
    except ValueError:
        return None
    return event if isinstance(event, dict) and event.get("command") == command else None
