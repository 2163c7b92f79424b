"""Bring up a layout: remote components as supervised processes, local ones in-process.

The front (the Gateway) always runs in this process. Each component is bound either
locally (its servicer built here on the shared `DeviceContext`, called directly) or
remotely (a child process behind a gRPC server on a unix socket). All local, it is the
spine; all remote, it is the layered stack; anything between is a migration stage.

`Stack` puts the pieces together, each built by a class of its own: the components and
their bindings (`runtime.placement.components`), the pipeline and the gateway over them, the batching
of whatever is local (`runtime.gateway_batching`), /metrics (`runtime.observability.metrics_endpoint`),
the listeners (`runtime.listeners`), the shadow mirror (`runtime.shadow.gateway_mirror`) and the
gateway's health (`runtime.layout_health`).
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from monolith.batched_pipeline import BatchedAdmission, DeferredCompletions
from monolith.device_on_use import DeviceOnFirstUse
from runtime.config.file import internal_key, layout_name
from runtime.config.model import SpineConfig
from runtime.config.model_sizes import model_sizes
from runtime.gateway_batching import GatewayBatching
from runtime.health.gateway import GatewayHealth
from runtime.layout_health import LayoutHealth
from runtime.listeners import Listeners
from runtime.observability.metrics_endpoint import MetricsExports
from runtime.placement.components import Components
from runtime.placement.foreign import envoy_apis
from runtime.processes.run_dir import write_private
from runtime.processes.supervisor import Supervisor
from runtime.server import RunningServer
from services.common.outlier import OutlierPolicy
from services.gateway.service import Gateway
from services.gateway.steps import AnswerTaps, InFlight
from services.inference.output_policy import OutputPolicy
from services.pipeline.calls import Hook
from services.pipeline.interface import Interface
from services.pipeline.limits import ModelSizes
from services.pipeline.pipeline import FailOpenCount, Pipeline
from services.registry import DEFAULT, Registry

if TYPE_CHECKING:  # torch is imported only where a component allocates a tensor
    from monolith.device import DeviceContext

log = logging.getLogger("runtime")
T = TypeVar("T")


@dataclass
class Stack:
    """One running layout, given a placement for every component."""

    config: SpineConfig
    placements: Mapping[str, str]
    listen: str = "127.0.0.1:0"
    run_dir: Path | None = None
    allow_external: bool = False
    hooks: Sequence[Hook] = ()
    # A plaintext listener answering health alone, for Kubernetes' grpc probes (they cannot
    # speak TLS): `spine up --probe-listen`.
    probe_listen: str | None = None
    # Components already served elsewhere (e.g. the layered stack's children, which a spine
    # in mid-migration shares): bound remotely to these addresses instead of spawned.
    remote_addresses: Mapping[str, str] = field(default_factory=dict)
    registry: Registry = DEFAULT
    # Made at start from the config's `device` section, the real context (and torch) on
    # first use: a stack with every component remote (the layered gateway) never makes one,
    # and never imports torch (its steps live apart from the servicers that keep tensors).
    device: DeviceContext | DeviceOnFirstUse | None = None  # or one the caller shares
    # Servicers the caller built, used instead of building them (e.g. a model behind a fault switch).
    servicers: Mapping[str, Any] = field(default_factory=dict)
    # How often the gateway asks each remote component's health, and how long it waits: a
    # component that stops answering turns the gateway NOT_SERVING within the interval plus
    # two deadlines (a late answer is asked again once).
    health_interval_s: float = 0.5
    health_timeout_s: float = 0.5
    # The OpenAI/Anthropic-compatible HTTP API (`runtime.http`) in front of the same
    # gateway, on this address (None: none). `spine up` passes `--http-listen` or `http.listen`.
    http_listen: str | None = None
    gateway: Gateway | None = None
    pipeline: Pipeline | None = None
    shadow: Any = None  # the spine's own mirror, with shadow.layered_address (runtime.shadow.gateway_mirror)
    components: Components | None = None
    batching: GatewayBatching | None = None
    metrics: MetricsExports | None = None
    listeners: Listeners | None = None
    layout_health: LayoutHealth | None = None
    # The admin token: with one, the admin API (keys managed at run time, spend) is served on
    # the gRPC and HTTP listeners (`runtime.admin_api`); None: it is off.
    admin_token: str | None = None
    admin: Any = None
    model_sizes: ModelSizes | None = None  # each model's context length, its request limits' size
    _tmp: Any = None

    @property
    def layout(self) -> str:
        return layout_name(self.placements)

    @property
    def address(self) -> str:
        assert self.server is not None, "stack not started"
        return self.server.address

    def start(self) -> str:
        """Start everything and return the Gateway's address once all is SERVING."""
        calls = self.config.calls
        budgets_ms = calls.budgets_ms.given()
        outlier = OutlierPolicy(calls.eject_after_failures, calls.ejection_ms / 1000.0, calls.max_ejection_ms / 1000.0)
        if self.run_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="spine-")
            self.run_dir = Path(self._tmp.name)
        config_path = write_private(self.run_dir, "config.yaml", self.config.to_yaml())
        self.model_sizes = model_sizes(self.config).start()  # upstream engines asked off the request path
        limits = self.config.limits.sized(self.model_sizes)
        if self.device is None:
            self.device = DeviceOnFirstUse(self.config.device)
        from runtime.observability.tracing import installed

        tracing = installed()
        genai = None
        if tracing is not None:  # spans with the same names in every layout, and a GenAI span per model call
            from runtime.observability.genai_spans import GenAiSpans

            self.hooks = [*self.hooks, tracing.hook(self.layout)]
            genai = GenAiSpans(tracing.tracer)
        components = self.components = Components(
            self.registry, self.config, self.placements, run_dir=self.run_dir, device=self.device,
            remote_addresses=self.remote_addresses, tls=self.config.tls, foreign=self.config.placements.foreign(),
            budgets_ms=budgets_ms, outlier=outlier, max_message_bytes=limits.max_message_bytes,
            health_timeout_s=self.health_timeout_s, servicers=self.servicers)
        listeners = self.listeners = Listeners(self.config, allow_external=self.allow_external, tls=self.config.tls,
                                      max_message_bytes=limits.max_message_bytes)
        try:
            components.start(config_path)
            fail_opens = FailOpenCount()
            self.pipeline = Pipeline(self.registry.steps(limits, budgets_ms), components.placed, hooks=self.hooks,
                                     on_fail_open=fail_opens)
            in_flight, answered = InFlight(), AnswerTaps()
            self.batching = GatewayBatching(in_flight, self.pipeline, components, self.config.batching)
            self.batching.attach()
            self.gateway = Gateway(self.pipeline, limits, self.layout, fail_opens=fail_opens,
                                   internal_key=internal_key(self.config), policy=OutputPolicy.of(self.config.output_policy),
                                   genai=genai, steps=self.batching, in_flight=in_flight, answered=answered)
            self.metrics = MetricsExports(components.local_servicers, self.config, self.run_dir,
                                          components.local_inference)
            self.metrics.start()
            # Envoy's APIs for the components that have one, answered by each one as placed at
            # the time of each call (see `runtime.placement.foreign`).
            envoy = envoy_apis(self.registry, self.config, components.placed,
                               {name: ms / 1000.0 for name, ms in budgets_ms.items()})
            if self.admin_token:
                from runtime.admin_api import AdminApi

                self.admin = AdminApi(self.config.auth, self.config.ratelimit, self.run_dir, self.admin_token)
            server = listeners.start_grpc(self.gateway, self.listen, envoy, self.config.envoy_api.listen, self.registry,
                                       self.probe_listen, self.admin.grpc_services() if self.admin else None)
            listeners.start_http(self.gateway, self.http_listen,
                              serving=lambda: self.health is None or self.health.serving is not False,
                              admin=self.admin)
            from runtime.shadow.gateway_mirror import start_gateway_mirror

            self.shadow = start_gateway_mirror(self.config, answered, server.address,
                                               components.local_servicers.get("metrics"))
            self.layout_health = LayoutHealth(components, listeners, self.config, interval_s=self.health_interval_s,
                                              timeout_s=self.health_timeout_s)
            self.layout_health.start(server)
        except BaseException:
            self.stop()
            raise
        log.info("%s layout serving on %s", self.layout, server.address)
        return server.address

    # -- the parts, as callers (tests, tools) read them --------------------------------------
    @property
    def supervisor(self) -> Supervisor | None:
        return None if self.components is None else self.components.supervisor

    @property
    def local_servicers(self) -> dict[str, Any]:
        return {} if self.components is None else self.components.local_servicers

    def component(self, interface: Interface[T]) -> T:
        """A component as this layout reaches it now (its servicer, a remote proxy or a foreign client)."""
        assert self.components is not None, "stack not started"
        return self.components.placed.get(interface)

    @property
    def server(self) -> RunningServer | None:
        return None if self.listeners is None else self.listeners.server

    @property
    def envoy_server(self) -> RunningServer | None:
        return None if self.listeners is None else self.listeners.envoy_server

    @property
    def http_server(self) -> Any:
        return None if self.listeners is None else self.listeners.http_server

    @property
    def http_address(self) -> str | None:
        return None if self.http_server is None else self.http_server.address

    @property
    def health(self) -> GatewayHealth | None:
        """The gateway's, from every component's."""
        return None if self.layout_health is None else self.layout_health.health

    @property
    def deep_health(self) -> Any:
        """The local model's (runtime.health.deep.DeepHealth)."""
        return None if self.layout_health is None else self.layout_health.deep_health

    @property
    def admission(self) -> BatchedAdmission | None:
        return None if self.batching is None else self.batching.batched_admission

    @property
    def completions(self) -> DeferredCompletions | None:
        return None if self.batching is None else self.batching.deferred

    @property
    def metrics_endpoint(self) -> Any:
        return None if self.metrics is None else self.metrics.metrics_endpoint

    @property
    def inference_metrics(self) -> Any:
        """The model's own /metrics, when the metrics component is remote."""
        return None if self.metrics is None else self.metrics.inference_metrics

    def health_report(self) -> dict[str, Any]:
        """The gateway's health, each component's, and each child's state (restarts, crash loops)."""
        if self.layout_health is None:
            return {"serving": None, "components": {}}
        return self.layout_health.report()

    def local_servicer(self, name: str) -> Any:
        """The servicer `name` runs on when placed here: built once on the stack's device
        (also before it is moved here, so it can be set up first), then kept across moves."""
        assert self.components is not None, "stack not started"
        return self.components.local_servicer(name)

    def set_placements(self, placements: Mapping[str, str]) -> None:
        """Move components between local and remote without a restart.

        Each move is one swap behind the component's interface: a request already past that
        step is unaffected; the next one reaches it where it is now. A component moved
        back to remote keeps its local servicer (and state) for the next move. Answers
        handed over to the old placement are written there first.
        """
        assert self.gateway is not None and self.components is not None and self.batching is not None, \
            "stack not started"
        merged = self.check_placements(placements)
        if merged != dict(self.placements):
            self.batching.drain()
        self.components.move(merged)
        self.placements = merged
        self.gateway.set_layout(self.layout)
        self.batching.attach()
        if self.layout_health is not None:  # the model moved here: the gateway's health reads its probe
            self.layout_health.start_deep_health(self.server)

    def check_placements(self, placements: Mapping[str, str]) -> dict[str, str]:
        """The placements after `placements` would be applied, or ConfigError naming the first
        one this stack cannot take; nothing is changed either way (`Components.check`)."""
        assert self.components is not None, "stack not started"
        return self.components.check(placements)

    def drain(self) -> None:
        """Write what finished requests handed over (before reading metrics, logs or the cache)."""
        if self.batching is not None:
            self.batching.drain()

    def metrics_address(self) -> str | None:
        """Where the Prometheus text is served (by this process or the metrics child)."""
        if self.run_dir is None:
            return None
        path = self.run_dir / "metrics.addr"
        return path.read_text().strip() if path.exists() else None

    def stop(self, grace: float = 3.0) -> None:
        """Finish in-flight requests, flush local logs and metrics, stop every child."""
        if self.shadow is not None:  # no more copies; those in flight finish first
            self.shadow.close()
            self.shadow = None
        if self.layout_health is not None:
            self.layout_health.stop()
        if self.listeners is not None:
            self.listeners.stop_http(grace)  # its in-flight requests finish on the gateway below
            self.listeners.stop_grpc(grace)
        if self.batching is not None:
            self.batching.close()
        if self.metrics is not None:
            self.metrics.stop()
        if self.components is not None:
            self.components.stop()
        if self.admin is not None:
            self.admin.close()
        if self.model_sizes is not None:
            self.model_sizes.stop()
            self.admin = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> Stack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
