"""The gateway's health tells the truth about the components a request cannot do without.

A gateway whose auth process is dead, stopped or NOT_SERVING cannot answer anything but
UNAVAILABLE; reporting SERVING would keep the front, xDS data planes and load balancers
sending it traffic. `GatewayHealth` runs in the gateway's process and, every `interval_s`,
looks at every component where it is placed now:

* remote: a `grpc.health.v1.Health/Check` for the component's service on the very channel
  the pipeline uses, all at once, each within `timeout_s` (a stopped process never answers:
  one that misses the deadline is asked again at once and is NOT_SERVING when it misses that
  one too, so one late answer on a loaded machine flips nothing); a supervised child that has exited or is in a
  crash loop is NOT_SERVING without asking (`Supervisor.down_reason`);
* local: a check the stack hands in (the model's deep health; the other local components
  serve while the process does).

Each component is reported under its own service name (`spine.v1.Auth`, ...). The gateway
(`""` and `spine.v1.Gateway`) is SERVING only while every *fail-closed* component is;
fail-open ones (cache, metrics, logs) are reported but never take the gateway down. With the
defaults (0.5 s each) a component that stops answering turns the gateway NOT_SERVING within
1.5 s at most (an interval plus two deadlines); one that says NOT_SERVING or whose process
exits, within one interval. Each flip is logged once, one line.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from runtime.health.watch import Rounds, check_many
from runtime.server import RunningServer
from services.pipeline.step import FailMode
from services.registry import GATEWAY, Registry

log = logging.getLogger("spine.health")

LocalCheck = Callable[[], tuple[bool, str]]
Target = grpc.Channel | LocalCheck


@dataclass(frozen=True)
class ComponentHealth:
    serving: bool
    reason: str


def always_serving() -> tuple[bool, str]:
    return True, "local: serving while this process is"


class GatewayHealth:
    """Watches every component and publishes the gateway's health from theirs."""

    def __init__(self, running: RunningServer, registry: Registry, targets: Callable[[], Mapping[str, Target]], *,
                 interval_s: float = 0.5, timeout_s: float = 0.5,
                 services: Sequence[str] = ("", GATEWAY.full_name),
                 on_flip: Callable[[str, ComponentHealth], None] | None = None) -> None:
        self.running = running
        self.on_flip = on_flip  # told of each component's flip (the bindings fail fast on it)
        self.registry = registry
        self.targets = targets
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.services = tuple(services)
        self.components: dict[str, ComponentHealth] = {}
        self.serving: bool | None = None
        self.reason = "not checked yet"
        self._lock = threading.Lock()
        self._rounds = Rounds(self.check_once, interval_s, "gateway-health", join_s=interval_s + 2 * timeout_s + 2.0)

    def start(self) -> GatewayHealth:
        """First round before it returns (the gateway is truthful from its first answer)."""
        self.check_once()
        self._rounds.start()
        return self

    def stop(self) -> None:
        self._rounds.stop()

    def check_once(self) -> bool:
        """Ask every remote component (at once, each within the deadline), read the local
        ones, publish; the gateway's new status."""
        targets = dict(self.targets())
        remote = {name: (target, self.registry[name].full_name) for name, target in targets.items()
                  if isinstance(target, grpc.Channel)}
        answers = check_many(remote, self.timeout_s)
        found = {name: ComponentHealth(*answers[name]) if name in answers else _local(target)  # type: ignore[arg-type]
                 for name, target in targets.items()}
        return self._publish(found)

    def refresh(self) -> bool:
        """Re-read the local checks only, keeping the last remote answers (called when the
        model's deep health changes, so that flip reaches the gateway at once)."""
        targets = dict(self.targets())
        found = {name: _local(target) for name, target in targets.items() if not isinstance(target, grpc.Channel)}
        return self._publish(found)

    def report(self) -> dict[str, Any]:
        """The gateway's status and each component's, with the reasons (for logs and status lines)."""
        with self._lock:
            return {"serving": self.serving, "reason": self.reason,
                    "components": {name: {"serving": state.serving, "reason": state.reason,
                                          "fail_mode": self.registry[name].fail_mode.value}
                                   for name, state in self.components.items()}}

    def _publish(self, found: Mapping[str, ComponentHealth]) -> bool:
        with self._lock:
            flipped = []
            for name, state in found.items():
                before = self.components.get(name)
                self.components[name] = state
                if before is None or before.serving != state.serving:
                    self.running.set_serving(state.serving, self.registry[name].full_name)
                    if self.on_flip is not None:
                        self.on_flip(name, state)
                    if before is not None or not state.serving:
                        flipped.append(name)
            down = [f"{name} ({state.reason})" for name, state in self.components.items()
                    if not state.serving and self._closed(name)]
            serving = not down
            reason = "every fail-closed component is SERVING" if serving else "; ".join(down)
            gateway_flips = serving != self.serving and (self.serving is not None or not serving)
            if gateway_flips:  # one line, naming the components that made it flip
                if serving:
                    log.info("gateway %s SERVING again", self.running.address)
                else:
                    log.warning("gateway %s NOT_SERVING: %s", self.running.address, reason)
            for name in flipped:
                if not (gateway_flips and self._closed(name)):
                    self._log_component(name, self.components[name])
            if serving != self.serving:
                for service in self.services:
                    self.running.set_serving(serving, service)
            self.serving, self.reason = serving, reason
            return serving

    def _closed(self, name: str) -> bool:
        return self.registry[name].fail_mode is FailMode.CLOSED

    def _log_component(self, name: str, state: ComponentHealth) -> None:
        if state.serving:
            log.info("%s SERVING again", name)
        elif not self._closed(name):
            log.warning("%s NOT_SERVING (fail-open: requests go on without it): %s", name, state.reason)
        else:
            log.warning("%s NOT_SERVING: %s", name, state.reason)


def _local(check: LocalCheck) -> ComponentHealth:
    try:
        serving, reason = check()
    except Exception as error:  # a check that cannot tell is not a SERVING answer
        return ComponentHealth(False, f"health check raised {type(error).__name__}: {error}")
    return ComponentHealth(serving, reason)
