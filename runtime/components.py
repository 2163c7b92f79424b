"""Every component of a layout where it is placed, and the binding that reaches it.

A component placed `local` runs on a servicer built in this process on the shared device
(called directly, `LocalBinding`); one placed `remote` is a supervised child process on a
unix socket, or an address given (`remote_addresses`: the layered stack's children, which a
spine in mid-migration shares), reached over gRPC (`RemoteBinding`); one a placement binds
to a service the team already runs is reached in that service's protocol (`ForeignBinding`).
Moving a component swaps its binding; its local servicer (and its state) is kept for the
next move.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from runtime.binding_classes import foreign_binding, local_binding, remote_binding
from runtime.foreign import ForeignBinding
from runtime.gateway_health import ComponentHealth, Target, always_serving
from runtime.remote_binding import RemoteBinding, remote_channel
from runtime.sections import TlsConfig
from runtime.supervisor import Supervisor
from services.common import ConfigError
from services.common.outlier import OutlierDetector, OutlierPolicy
from services.pipeline.calls import Hook
from services.registry import Registry, close_servicer

log = logging.getLogger("runtime")


def _down(reason: str) -> Callable[[], tuple[bool, str]]:
    return lambda: (False, reason)


class Components:
    """The servicers, child processes and bindings of one layout's components."""

    def __init__(self, registry: Registry, config: Mapping[str, Any], placements: Mapping[str, str], *,
                 run_dir: Path, device: Any, hooks: Sequence[Hook], remote_addresses: Mapping[str, str],
                 tls: TlsConfig | None, foreign: Mapping[str, Any], budgets_ms: Mapping[str, float],
                 outlier: OutlierPolicy, max_message_bytes: int, health_timeout_s: float,
                 servicers: Mapping[str, Any] | None = None) -> None:
        self.registry = registry
        self.config = config
        self.placements = dict(placements)
        self.run_dir = run_dir
        self.device = device
        self.hooks = list(hooks)
        self.remote_addresses = remote_addresses
        self.tls = tls
        self.foreign = foreign  # components bound to the team's own services (their protocol, not ours)
        self.budgets_ms = budgets_ms
        self.outlier = outlier
        self.max_message_bytes = max_message_bytes
        self.health_timeout_s = health_timeout_s
        self.supervisor: Supervisor | None = None
        self.local_servicers: dict[str, Any] = dict(servicers or {})  # built by the caller, or on first use
        self.bindings: dict[str, Any] = {}
        self._retired: list[Any] = []
        self._detectors: dict[str, OutlierDetector] = {}

    def start(self, config_path: Path) -> None:
        """Spawn a child for each remote component that has no address, then bind every one."""
        remote = [name for name in self.registry.names
                  if self.placements[name] == "remote" and name not in self.remote_addresses
                  and name not in self.foreign]
        if remote:
            self.supervisor = Supervisor(self.run_dir)
            for name in remote:
                self.supervisor.add_component(name, config_path)
            self.supervisor.start()
        for name in self.registry.names:
            self.bindings[name] = self._bind(name)

    def local_servicer(self, name: str) -> Any:
        """The servicer `name` runs on when placed here: built once on the device (also before
        it is moved here, so it can be set up first), then kept across moves."""
        servicer = self.local_servicers.get(name)
        if servicer is None:
            servicer = self.registry[name].build(self.config, self.device, self.run_dir)
            self.local_servicers[name] = servicer
        return servicer

    def local_inference(self) -> Any:
        """The model's servicer while it runs in this process (what /metrics reads it from)."""
        return self.local_servicers.get("inference") if self.placements.get("inference") == "local" else None

    def _detector(self, name: str) -> OutlierDetector:
        """One per component, kept across moves: its record is the component's."""
        detector = self._detectors.get(name)
        if detector is None:
            budget_s = self.budgets_ms.get(name, self.registry[name].budget_ms) / 1000.0
            detector = self._detectors[name] = OutlierDetector(name, self.outlier, budget_s)
        return detector

    def _bind(self, name: str, placement: str | None = None) -> Any:
        spec = self.registry[name]
        if (placement or self.placements[name]) == "local":
            return local_binding(spec.descriptor())(name, spec.descriptor(), self.local_servicer(name), self.hooks)
        if name in self.foreign:  # a service the team already runs (`placements: {remote, protocol}`)
            endpoint = self.foreign[name]
            channel = remote_channel(endpoint.remote, self.max_message_bytes)
            return foreign_binding(spec.descriptor())(spec, endpoint, self.config, channel, self.hooks,
                                                      outlier=self._detector(name),
                                                      health_timeout_s=self.health_timeout_s)
        if name in self.remote_addresses:
            address = self.remote_addresses[name]
        else:
            assert self.supervisor is not None, f"{name} has no process to reach"
            address = self.supervisor.children[name].address
        channel = remote_channel(address, self.max_message_bytes, self.tls)
        return remote_binding(spec.descriptor())(name, spec.descriptor(), spec.stub_class(), channel, self.hooks,
                                                 outlier=self._detector(name))

    def check(self, placements: Mapping[str, str]) -> dict[str, str]:
        """The placements after `placements` would be applied, or ConfigError naming the first
        one these components cannot take (an unknown component, a value other than
        local|remote, a remote one there is no address for); nothing is changed either way."""
        merged = dict(self.placements)
        for name, placement in placements.items():
            if name not in self.registry.names:
                raise ConfigError(f"placements.{name}: unknown component; this spine has "
                                  f"{', '.join(self.registry.names)}")
            if placement not in ("local", "remote"):
                raise ConfigError(f"placements.{name}: must be local or remote, got {placement!r}")
            reachable = name in self.remote_addresses or name in self.foreign or (
                self.supervisor is not None and name in self.supervisor.children)
            if placement == "remote" and self.placements[name] != "remote" and not reachable:
                raise ConfigError(f"placements.{name}: remote, but this spine has no {name} process to call "
                                  f"(give it remote_addresses.{name} in its config)")
            merged[name] = placement
        return merged

    def move(self, merged: Mapping[str, str]) -> None:
        """Swap the binding of each component whose placement changes: one assignment in the
        pipeline's table of clients (it holds this very dict) for each."""
        for name in self.registry.names:
            if merged[name] == self.placements[name]:
                continue
            old = self.bindings[name]
            self.bindings[name] = self._bind(name, merged[name])
            self._retired.append(old)  # closed at stop(): in-flight calls on it finish first
        self.placements = dict(merged)

    def flipped(self, name: str, state: ComponentHealth) -> None:
        """A component the gateway cannot reach fails fast: calls to it end at once with
        UNAVAILABLE instead of each waiting out its budget, until it is SERVING again."""
        detector = self._detectors.get(name)
        if detector is not None:
            detector.set_health(state.serving, state.reason)
        binding = self.bindings.get(name)
        if not state.serving and isinstance(binding, RemoteBinding):
            abandoned = binding.abandon(state.reason)
            if abandoned:
                log.warning("%s stopped answering: %d call(s) waiting on it end UNAVAILABLE", name, abandoned)

    def health_targets(self, model_health: Target | None) -> dict[str, Target]:
        """What the gateway's health looks at for each component, where it is placed now
        (`model_health`: the local model's deep health, when it runs one)."""
        targets: dict[str, Target] = {}
        for name in self.registry.names:
            binding = self.bindings.get(name)
            if binding is None:
                continue
            if isinstance(binding, ForeignBinding):  # the team's own service: its own health
                targets[name] = binding.health
            elif isinstance(binding, RemoteBinding):
                supervisor = self.supervisor
                down = supervisor.down_reason(name) if supervisor is not None and name in supervisor.children else None
                targets[name] = binding.channel if down is None else _down(down)
            elif name == "inference" and model_health is not None:
                targets[name] = model_health
            elif (check := getattr(self.local_servicers.get(name), "local_health", None)) is not None:
                targets[name] = check  # e.g. the rate limiter's shared store: leasing or falling back
            else:
                targets[name] = always_serving
        return targets

    def stop(self) -> None:
        """Close every local servicer and binding, then stop every child."""
        for servicer in self.local_servicers.values():
            close_servicer(servicer)
        self.local_servicers.clear()
        for binding in [*self.bindings.values(), *self._retired]:
            binding.close()
        self.bindings.clear()
        self._retired.clear()
        if self.supervisor is not None:
            self.supervisor.stop()
            self.supervisor = None
