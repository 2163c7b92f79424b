"""The spine as a process of its own: `spine up --layout mixed`, following the controller's
stages over ADS, its faults switched through its stdin.

Why: in the demo's process the spine's gateway, middlewares and model shared one
interpreter with the front, the controller, the xDS server and the traffic's bookkeeping,
while the layered side had processes of its own; `make run`'s tables then compared a spine
slowed by the harness with a layered stack that was not (at 10%: p50 50.1 vs 40.9 ms, p99
twice the layered side's at every stage). Here both sides are what they are in production.

- It starts on the demo's placements (the model local, every middleware remote, in the
  layered stack's processes: `remote_addresses`) and then follows the controller's stages
  over ADS like any replica (`spine.runtime.stage_follower`): placements moved live and its
  share of every limit, each stage ACKed once applied (`FrontTarget.applied` waits for it).
- `--inject-fault switchable`: the demo's faults (half the model's calls failing, wrong
  answers) are switched by lines on its stdin, a pipe only this process holds
  (`spine.runtime.faults.FaultSwitch`); each switch waits for the child's answer.
"""

from __future__ import annotations

import json
import queue
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from migration.traffic.layout_process import LayoutProcess
from services.registry import MIDDLEWARES
from spine.runtime.config import merge

SWITCH_TIMEOUT_S = 5.0


class FaultNotSwitched(RuntimeError):
    """The spine process refused a fault switch or did not answer it in time."""


class SpineProcess(LayoutProcess):
    """A spine replica in its own process, following the xDS control plane at `controller`."""

    name = "spine"

    def __init__(self, config: Mapping[str, Any], run_dir: Path, *, controller: str,
                 remote: Mapping[str, str], node_id: str = "demo-spine") -> None:
        placed = {"placements": {"inference": "local", **dict.fromkeys(MIDDLEWARES, "remote")},
                  "remote_addresses": dict(remote)}
        super().__init__(merge(config, placed), run_dir)
        self.controller = controller
        self.node_id = node_id
        self._answers: queue.Queue[dict[str, Any]] = queue.Queue()

    def up_arguments(self) -> Sequence[str]:
        # No wait for a first stage: until the controller publishes one, the config's placements.
        return ("--layout", "mixed", "--follow-controller", self.controller, "--node-id", self.node_id,
                "--initial-fetch-timeout-s", "0", "--inject-fault", "switchable")

    def switch_fault(self, command: str) -> dict[str, Any]:
        """Send one `FaultSwitch` command and return the child's answer (the fault now)."""
        process = self.process
        if process is None or process.stdin is None or process.poll() is not None:
            raise FaultNotSwitched(f"{command!r}: the spine process is not running")
        while not self._answers.empty():  # an answer nobody waited for (a timed-out switch)
            self._answers.get_nowait()
        try:
            process.stdin.write(command.encode() + b"\n")
            process.stdin.flush()
        except OSError as error:  # it exited between the check and the write (a broken pipe)
            raise FaultNotSwitched(f"{command!r}: the spine process is not reading ({error}); "
                                   f"see {self.log_path}") from None
        try:
            answer = self._answers.get(timeout=SWITCH_TIMEOUT_S)
        except queue.Empty:
            raise FaultNotSwitched(f"{command!r}: no answer from the spine process within {SWITCH_TIMEOUT_S:g}s; "
                                   f"see {self.log_path}") from None
        if answer.get("event") != "fault":
            raise FaultNotSwitched(f"{command!r}: refused by the spine process: {answer.get('why', answer)}")
        return answer

    def _stdin(self) -> int:
        return subprocess.PIPE

    def _read_after_ready(self, stdout: IO[bytes]) -> None:
        """The answers to fault switches, one JSON line each."""
        try:
            for line in stdout:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if isinstance(event, dict) and str(event.get("event", "")).startswith("fault"):
                    self._answers.put(event)
        except (OSError, ValueError):
            pass
        finally:
            stdout.close()
