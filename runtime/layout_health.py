"""A layout's health: the gateway's, from every component's where it is placed now.

The gateway is SERVING only while every fail-closed component is: the front, xDS endpoints,
the A/B tool and load balancers all read this. A remote component's health is its child's
(or its channel's), the local model's is its deep health (a tiny forward on its device in
time), another local component's is its own check where it has one. A change fails calls to
a component that went away fast (`Components.flipped`) and flips its Envoy API's health.
"""

from __future__ import annotations

from typing import Any

from runtime.config.model import SpineConfig
from runtime.health.gateway import ComponentHealth, GatewayHealth
from runtime.listeners import Listeners
from runtime.placement.components import Components
from runtime.server import RunningServer


class LayoutHealth:
    """The gateway's health over a layout's components, and the local model's deep health."""

    def __init__(self, components: Components, listeners: Listeners, config: SpineConfig, *,
                 interval_s: float, timeout_s: float) -> None:
        self.components = components
        self.listeners = listeners
        self.config = config
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.deep_health: Any = None  # the local model's (runtime.health.deep.DeepHealth)
        self.health: GatewayHealth | None = None

    def start(self, server: RunningServer) -> GatewayHealth:
        """Start asking every component's health; the gateway's health, as it runs."""
        self.start_deep_health(server)
        health = self.health = GatewayHealth(server, self.components.registry, self._targets,
                                             interval_s=self.interval_s, timeout_s=self.timeout_s,
                                             on_flip=self._flipped).start()
        return health

    def start_deep_health(self, server: RunningServer | None) -> None:
        """The local model's deep health, once the model runs here. It publishes nothing
        itself; the gateway's health reads it and hears of each change."""
        if self.deep_health is not None or "inference" not in self.components.local_servicers or server is None:
            return
        from runtime.health.deep import start_deep_health

        inference = self.config.inference
        self.deep_health = start_deep_health(
            server, self.components.local_servicers["inference"], inference.health_interval_s,
            inference.health_timeout_s, services=(), on_change=self._local_changed)

    def _flipped(self, name: str, state: ComponentHealth) -> None:
        self.components.flipped(name, state)
        self.listeners.flip(name, state.serving)

    def _local_changed(self) -> None:
        if self.health is not None:
            self.health.refresh()

    def _targets(self) -> Any:
        return self.components.health_targets(self._model_health if self.deep_health is not None else None)

    def _model_health(self) -> tuple[bool, str]:
        deep = self.deep_health
        if deep is None:
            return True, "local"
        return deep.serving is True, deep.reason

    def report(self) -> dict[str, Any]:
        """The gateway's health, each component's, and each child's state (restarts, crash loops)."""
        report = self.health.report() if self.health is not None else {"serving": None, "components": {}}
        supervisor = self.components.supervisor
        if supervisor is not None:
            report["children"] = supervisor.status()
        return report

    def stop(self) -> None:
        if self.health is not None:
            self.health.stop()
            self.health = None
        if self.deep_health is not None:
            self.deep_health.stop()
            self.deep_health = None
