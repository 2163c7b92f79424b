"""A started layout: the record `Stack.start()` returns, its parts as they run.

`Stack` (runtime.stack) says what to run; this is what runs. Every part is here from the
moment the record exists (frozen: nothing is filled in later, and a part that is absent, the
admin API or the shadow mirror, is absent because the settings leave it out), so no reader
checks whether the stack has started yet. The parts started under one `ExitStack`
(`runtime.running_parts`): `stop()` stops them in the reverse of the order they started.

What changes while a layout runs (where each component is placed, whether requests are
batched) changes through the part that owns it (`Components.move`, `GatewayBatching.attach`),
driven by `set_placements`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from monolith.batched_pipeline import BatchedAdmission, DeferredCompletions
from monolith.device_on_use import DeviceOnFirstUse
from runtime.config.file import layout_name
from runtime.config.model import SpineConfig
from runtime.gateway_batching import GatewayBatching
from runtime.health.gateway import GatewayHealth
from runtime.layout_health import LayoutHealth
from runtime.listeners import Listeners
from runtime.observability.metrics_endpoint import MetricsExports
from runtime.placement.components import Components
from runtime.processes.supervisor import Supervisor
from runtime.running_parts import RunningParts
from runtime.server import RunningServer
from services.gateway.service import Gateway
from services.pipeline.calls import Hook
from services.pipeline.interface import Interface
from services.pipeline.limits import ModelSizes
from services.pipeline.pipeline import Pipeline
from services.registry import Registry

if TYPE_CHECKING:  # torch is imported only where a component allocates a tensor
    from monolith.device import DeviceContext
    from runtime.admin_api import AdminApi
    from runtime.shadow.gateway_mirror import GatewayMirror

T = TypeVar("T")


@dataclass(frozen=True)
class RunningStack(RunningParts):
    """One running layout: its gateway, the pipeline and components under it, its listeners.

    `admin` is None without an admin token, `shadow` None unless the config mirrors to a
    layered side. `stop()` finishes in-flight requests, flushes local logs and metrics and
    stops every child, in the reverse of the order they started."""

    config: SpineConfig = field(repr=False)  # it may hold the internal secret
    registry: Registry = field(repr=False)
    run_dir: Path
    device: DeviceContext | DeviceOnFirstUse = field(repr=False)
    hooks: Sequence[Hook] = field(repr=False)  # as run: with the installed tracing's, if any
    model_sizes: ModelSizes = field(repr=False)  # each model's context length, its request limits' size
    components: Components = field(repr=False)
    listeners: Listeners = field(repr=False)
    pipeline: Pipeline = field(repr=False)
    batching: GatewayBatching = field(repr=False)
    gateway: Gateway = field(repr=False)
    metrics: MetricsExports = field(repr=False)
    admin: AdminApi | None = field(repr=False)  # the admin API (`runtime.admin_api`), with an admin token
    server: RunningServer  # the gateway's gRPC listener
    shadow: GatewayMirror | None = field(repr=False)  # the spine's own mirror (`runtime.shadow.gateway_mirror`)
    layout_health: LayoutHealth = field(repr=False)
    health: GatewayHealth = field(repr=False)  # the gateway's, from every component's

    # -- where it is and how it is laid out ---------------------------------------------------
    @property
    def address(self) -> str:
        """The gateway's gRPC address."""
        return self.server.address

    @property
    def placements(self) -> dict[str, str]:
        """Each component's placement now (`set_placements` moves them)."""
        return dict(self.components.placements)

    @property
    def layout(self) -> str:
        return layout_name(self.components.placements)

    # -- the parts, as callers (tests, tools) read them --------------------------------------
    @property
    def supervisor(self) -> Supervisor | None:
        """The children of the remote components this stack spawned (None: it spawned none)."""
        return self.components.supervisor

    @property
    def local_servicers(self) -> dict[str, Any]:
        return self.components.local_servicers

    def component(self, interface: Interface[T]) -> T:
        """A component as this layout reaches it now (its servicer, a remote proxy or a foreign client)."""
        return self.components.placed.get(interface)

    @property
    def envoy_server(self) -> RunningServer | None:
        """Envoy's APIs' listener (None without `envoy_api.listen`)."""
        return self.listeners.envoy_server

    @property
    def http_server(self) -> Any:
        """The HTTP API's server (None without `http_listen`)."""
        return self.listeners.http_server

    @property
    def http_address(self) -> str | None:
        return None if self.http_server is None else self.http_server.address

    @property
    def deep_health(self) -> Any:
        """The local model's (runtime.health.deep.DeepHealth); None while the model is remote."""
        return self.layout_health.deep_health

    @property
    def admission(self) -> BatchedAdmission | None:
        """Admission in batches, while every admission step is local (else None)."""
        return self.batching.batched_admission

    @property
    def completions(self) -> DeferredCompletions | None:
        """Completions handed over after the answer, while they are local (else None)."""
        return self.batching.deferred

    @property
    def metrics_endpoint(self) -> Any:
        """This process's /metrics, when the metrics component is local (else None)."""
        return self.metrics.metrics_endpoint

    @property
    def inference_metrics(self) -> Any:
        """The model's own /metrics, when the metrics component is remote."""
        return self.metrics.inference_metrics

    def health_report(self) -> dict[str, Any]:
        """The gateway's health, each component's, and each child's state (restarts, crash loops)."""
        return self.layout_health.report()

    def local_servicer(self, name: str) -> Any:
        """The servicer `name` runs on when placed here: built once on the stack's device
        (also before it is moved here, so it can be set up first), then kept across moves."""
        return self.components.local_servicer(name)

    def metrics_address(self) -> str | None:
        """Where the Prometheus text is served (by this process or the metrics child)."""
        path = self.run_dir / "metrics.addr"
        return path.read_text().strip() if path.exists() else None

    # -- what changes while it runs ------------------------------------------------------------
    def set_placements(self, placements: Mapping[str, str]) -> None:
        """Move components between local and remote without a restart.

        Each move is one swap behind the component's interface: a request already past that
        step is unaffected; the next one reaches it where it is now. A component moved
        back to remote keeps its local servicer (and state) for the next move. Answers
        handed over to the old placement are written there first.
        """
        merged = self.check_placements(placements)
        if merged != self.components.placements:
            self.batching.drain()
        self.components.move(merged)
        self.gateway.set_layout(self.layout)
        self.batching.attach()
        self.layout_health.start_deep_health(self.server)  # the model moved here: the gateway's health reads its probe

    def check_placements(self, placements: Mapping[str, str]) -> dict[str, str]:
        """The placements after `placements` would be applied, or ConfigError naming the first
        one this stack cannot take; nothing is changed either way (`Components.check`)."""
        return self.components.check(placements)

    def drain(self) -> None:
        """Write what finished requests handed over (before reading metrics, logs or the cache)."""
        self.batching.drain()
