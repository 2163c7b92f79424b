"""Every component of a layout where it is placed, and what reaches it behind its interface.

A component placed `local` runs on a servicer built in this process on the shared device
(`runtime.placement.in_process`); one placed `remote` is a supervised child process on a unix socket,
or an address given (`remote_addresses`: the layered stack's children, which a spine in
mid-migration shares), reached over gRPC (`runtime.placement.remote`); one a placement binds to a
service the team already runs is reached in that service's protocol (`runtime.placement.foreign`).
Callers hold none of these: they ask `placed` for the component's interface at each call, so
moving a component swaps one object there; its local servicer (and its state) is kept for
the next move.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from runtime.config.model import SpineConfig
from runtime.config.sections import ForeignPlacement, TlsConfig
from runtime.health.gateway import ComponentHealth, Target, always_serving
from runtime.placement.foreign import foreign_client, foreign_health
from runtime.placement.in_process import in_process
from runtime.placement.remote import RemoteComponent, loop_link, remote, remote_channel
from runtime.placement.remote_model import RemoteModel
from runtime.processes.supervisor import Supervisor
from services.common import ConfigError
from services.common.outlier import OutlierDetector, OutlierPolicy
from services.pipeline.interface import Placed
from services.registry import Registry, close_servicer

log = logging.getLogger("runtime")


def _down(reason: str) -> Callable[[], tuple[bool, str]]:
    return lambda: (False, reason)


@dataclass(frozen=True)
class _Reached:
    """How a component is reached now: the implementation callers get, and for one in another
    process its channel (closed when it is retired) and what its health is read from."""

    implementation: object
    channel: grpc.Channel | None = None
    health: Target | None = None


class Components:
    """The servicers, child processes and placed implementations of one layout's components."""

    def __init__(self, registry: Registry, config: SpineConfig, placements: Mapping[str, str], *,
                 run_dir: Path, device: Any, remote_addresses: Mapping[str, str],
                 tls: TlsConfig | None, foreign: Mapping[str, ForeignPlacement], budgets_ms: Mapping[str, float],
                 outlier: OutlierPolicy, max_message_bytes: int, health_timeout_s: float,
                 servicers: Mapping[str, Any] | None = None) -> None:
        self.registry = registry
        self.config = config
        self.placements = dict(placements)
        self.run_dir = run_dir
        self.device = device
        self.remote_addresses = remote_addresses
        self.tls = tls
        self.foreign = foreign  # components bound to the team's own services (their protocol, not ours)
        self.budgets_ms = budgets_ms
        self.outlier = outlier
        self.max_message_bytes = max_message_bytes
        self.health_timeout_s = health_timeout_s
        self.supervisor: Supervisor | None = None
        self.local_servicers: dict[str, Any] = dict(servicers or {})  # built by the caller, or on first use
        self.placed = Placed()  # what the pipeline, the gateway and Envoy's APIs call
        self._reached: dict[str, _Reached] = {}
        self._retired: list[_Reached] = []
        self._detectors: dict[str, OutlierDetector] = {}

    def start(self, config_path: Path) -> None:
        """Spawn a child for each remote component that has no address, then reach every one."""
        remote = [name for name in self.registry.names
                  if self.placements[name] == "remote" and name not in self.remote_addresses
                  and name not in self.foreign]
        if remote:
            self.supervisor = Supervisor(self.run_dir)
            for name in remote:
                self.supervisor.add_component(name, config_path)
            self.supervisor.start()
        for name in self.registry.names:
            reached = self._reached[name] = self._reach(name, self.placements[name])
            self.placed.swap(name, reached.implementation)

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

    def _reach(self, name: str, placement: str) -> _Reached:
        spec = self.registry[name]
        interface = spec.interface
        assert interface is not None, f"{name} has no interface to be reached through"
        if placement == "local":
            return _Reached(in_process(interface, self.local_servicer(name)))
        if name in self.foreign:  # a service the team already runs (`placements: {remote, protocol}`)
            endpoint = self.foreign[name]
            channel = remote_channel(endpoint.remote, self.max_message_bytes)
            client = foreign_client(spec, endpoint, self.config, channel, self._detector(name))
            return _Reached(client, channel, foreign_health(endpoint, channel, self.health_timeout_s))
        if name in self.remote_addresses:
            address = self.remote_addresses[name]
        else:
            assert self.supervisor is not None, f"{name} has no process to reach"
            address = self.supervisor.children[name].address
        channel = remote_channel(address, self.max_message_bytes, self.tls)
        stub_class = spec.stub_class()
        on_loop = loop_link(address, self.max_message_bytes, stub_class, self.tls)
        base = RemoteModel if name == "inference" else RemoteComponent
        return _Reached(remote(interface, stub_class(channel), channel, self._detector(name), on_loop, base), channel)

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
        """Swap what reaches each component whose placement changes: one swap in `placed`, which
        every caller asks at each call."""
        for name in self.registry.names:
            if merged[name] == self.placements[name]:
                continue
            reached = self._reach(name, merged[name])
            old = self._reached[name]
            self._reached[name] = reached
            self.placed.swap(name, reached.implementation)
            self._retired.append(old)  # closed at stop(): in-flight calls on it finish first
        self.placements = dict(merged)

    def flipped(self, name: str, state: ComponentHealth) -> None:
        """A component the gateway cannot reach fails fast: calls to it end at once with
        UNAVAILABLE instead of each waiting out its budget, until it is SERVING again."""
        detector = self._detectors.get(name)
        if detector is not None:
            detector.set_health(state.serving, state.reason)
        reached = self._reached.get(name)
        if not state.serving and reached is not None and isinstance(reached.implementation, RemoteComponent):
            abandoned = reached.implementation.abandon(state.reason)
            if abandoned:
                log.warning("%s stopped answering: %d call(s) waiting on it end UNAVAILABLE", name, abandoned)

    def health_targets(self, model_health: Target | None) -> dict[str, Target]:
        """What the gateway's health looks at for each component, where it is placed now
        (`model_health`: the local model's deep health, when it runs one)."""
        targets: dict[str, Target] = {}
        for name in self.registry.names:
            reached = self._reached.get(name)
            if reached is None:
                continue
            if reached.health is not None:  # the team's own service: its own health
                targets[name] = reached.health
            elif reached.channel is not None:
                supervisor = self.supervisor
                down = supervisor.down_reason(name) if supervisor is not None and name in supervisor.children else None
                targets[name] = reached.channel if down is None else _down(down)
            elif name == "inference" and model_health is not None:
                targets[name] = model_health
            elif (check := getattr(self.local_servicers.get(name), "local_health", None)) is not None:
                targets[name] = check  # e.g. the rate limiter's shared store: leasing or falling back
            else:
                targets[name] = always_serving
        return targets

    def stop(self) -> None:
        """Close every local servicer and channel, then stop every child."""
        for servicer in self.local_servicers.values():
            close_servicer(servicer)
        self.local_servicers.clear()
        for reached in [*self._reached.values(), *self._retired]:
            if reached.channel is not None:
                reached.channel.close()
        self._reached.clear()
        self._retired.clear()
        if self.supervisor is not None:
            self.supervisor.stop()
            self.supervisor = None
