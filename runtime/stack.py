"""Bring up a layout: remote components as supervised processes, local ones in-process.

The gateway always runs in this process. Each component is bound either
locally (its servicer built here on the shared `DeviceContext`, called directly) or
remotely (a child process behind a gRPC server on a unix socket). All local, it is the
spine; all remote, it is the layered stack; anything between is a migration stage.

`Stack` says what to run; `Stack.start()` starts it and returns a `RunningStack`
(`runtime.running_stack`), the parts as they run. The parts start one after another under
one `ExitStack` (`runtime.running_parts`): a part that fails to start stops the ones started
before it, and `RunningStack.stop()` stops them in the reverse of the order they started.
Each part is built by a class of its own: the components and their bindings
(`runtime.placement.components`), the pipeline and the gateway over them, the batching of
whatever is local (`runtime.gateway_batching`), /metrics (`runtime.observability.metrics_endpoint`),
the listeners (`runtime.listeners`), the shadow mirror (`runtime.shadow.gateway_mirror`) and the
gateway's health (`runtime.layout_health`).
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from monolith.device_on_use import DeviceOnFirstUse
from runtime.config.file import internal_key, layout_name
from runtime.config.model import SpineConfig
from runtime.config.model_sizes import model_sizes
from runtime.gateway_batching import GatewayBatching
from runtime.layout_health import LayoutHealth
from runtime.listeners import Listeners
from runtime.observability.metrics_endpoint import MetricsExports
from runtime.placement.components import Components
from runtime.placement.foreign import envoy_apis
from runtime.processes.run_dir import write_private
from runtime.running_stack import RunningStack
from services.common.outlier import OutlierPolicy
from services.gateway.service import Gateway
from services.gateway.steps import AnswerTaps, InFlight
from services.inference.output_policy import OutputPolicy
from services.pipeline.calls import Hook
from services.pipeline.pipeline import FailOpenCount, Pipeline
from services.registry import DEFAULT, Registry

if TYPE_CHECKING:  # torch is imported only where a component allocates a tensor
    from monolith.device import DeviceContext

log = logging.getLogger("runtime")

# How long stopping waits for the listeners' requests in flight.
STOP_GRACE_S = 3.0


@dataclass(frozen=True)
class Stack:
    """One layout to run, given a placement for every component; `start()` runs it."""

    config: SpineConfig = field(repr=False)  # it may hold the internal secret
    placements: Mapping[str, str]
    listen: str = "127.0.0.1:0"
    run_dir: Path | None = None  # None: a temporary directory, removed when the stack stops
    allow_external: bool = False
    hooks: Sequence[Hook] = ()
    # A plaintext listener answering health alone, for Kubernetes' grpc probes (they cannot
    # speak TLS): `spine up --probe-listen`.
    probe_listen: str | None = None
    # Components already served elsewhere (e.g. the layered stack's children, which a spine
    # in mid-migration shares): bound remotely to these addresses instead of spawned.
    remote_addresses: Mapping[str, str] = field(default_factory=dict)
    registry: Registry = DEFAULT
    # None: made at start from the config's `device` section, the real context (and torch) on
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
    # The admin token: with one, the admin API (keys managed at run time, spend) is served on
    # the gRPC and HTTP listeners (`runtime.admin_api`); None: it is off.
    admin_token: str | None = field(default=None, repr=False)

    @property
    def layout(self) -> str:
        return layout_name(self.placements)

    def start(self) -> RunningStack:
        """Start everything; what runs, once the gateway is SERVING.

        Should a part fail to start, those started before it are stopped and the error raised."""
        with ExitStack() as parts:  # left by an error: it stops what had started
            running = self._start(parts)
        log.info("%s layout serving on %s", self.layout, running.address)
        return running

    def _start(self, parts: ExitStack) -> RunningStack:
        config = self.config
        calls = config.calls
        budgets_ms = calls.budgets_ms.given()
        outlier = OutlierPolicy(calls.eject_after_failures, calls.ejection_ms / 1000.0, calls.max_ejection_ms / 1000.0)
        run_dir = self.run_dir
        if run_dir is None:
            run_dir = Path(parts.enter_context(tempfile.TemporaryDirectory(prefix="spine-")))
        config_path = write_private(run_dir, "config.yaml", config.to_yaml())
        sizes = model_sizes(config).start()  # upstream engines asked off the request path
        parts.callback(sizes.stop)
        limits = config.limits.sized(sizes)
        device = self.device if self.device is not None else DeviceOnFirstUse(config.device)
        hooks, genai = self._traced()
        components = Components(
            self.registry, config, self.placements, run_dir=run_dir, device=device,
            remote_addresses=self.remote_addresses, tls=config.tls, foreign=config.placements.foreign(),
            budgets_ms=budgets_ms, outlier=outlier, max_message_bytes=limits.max_message_bytes,
            health_timeout_s=self.health_timeout_s, servicers=self.servicers)
        parts.callback(components.stop)  # before it starts: one that fails half way stops its children
        components.start(config_path)
        fail_opens = FailOpenCount()
        pipeline = Pipeline(self.registry.steps(limits, budgets_ms), components.placed, hooks=hooks,
                            on_fail_open=fail_opens)
        in_flight, answered = InFlight(), AnswerTaps()
        batching = GatewayBatching(in_flight, pipeline, components, config.batching)
        parts.callback(batching.close)
        batching.attach()
        gateway = Gateway(pipeline, limits, self.layout, fail_opens=fail_opens, internal_key=internal_key(config),
                          policy=OutputPolicy.of(config.output_policy), genai=genai, steps=batching,
                          in_flight=in_flight, answered=answered)
        metrics = MetricsExports(components.local_servicers, config, run_dir, components.local_inference)
        parts.callback(metrics.stop)
        metrics.start()
        # Envoy's APIs for the components that have one, answered by each one as placed at
        # the time of each call (see `runtime.placement.foreign`).
        envoy = envoy_apis(self.registry, config, components.placed,
                           {name: ms / 1000.0 for name, ms in budgets_ms.items()})
        admin = None
        if self.admin_token:
            from runtime.admin_api import AdminApi

            admin = AdminApi(config.auth, config.ratelimit, run_dir, self.admin_token)
            parts.callback(admin.close)
        listeners = Listeners(config, allow_external=self.allow_external, tls=config.tls,
                              max_message_bytes=limits.max_message_bytes)
        layout_health = LayoutHealth(components, listeners, config, interval_s=self.health_interval_s,
                                     timeout_s=self.health_timeout_s)
        parts.callback(listeners.stop_grpc, STOP_GRACE_S)
        server = listeners.start_grpc(gateway, self.listen, envoy, config.envoy_api.listen, self.registry,
                                      self.probe_listen, admin.grpc_services() if admin is not None else None)
        parts.callback(listeners.stop_http, STOP_GRACE_S)  # first: its in-flight requests finish on the gateway
        listeners.start_http(gateway, self.http_listen, admin=admin,
                             serving=lambda: layout_health.health is None or layout_health.health.serving is not False)
        from runtime.shadow.gateway_mirror import start_gateway_mirror

        parts.callback(layout_health.stop)  # before the mirror's start: it stops after the mirror
        shadow = start_gateway_mirror(config, answered, server.address, components.local_servicers.get("metrics"))
        if shadow is not None:  # first of all: no more copies; those in flight finish
            parts.callback(shadow.close)
        health = layout_health.start(server)
        return RunningStack(
            config=config, registry=self.registry, run_dir=run_dir, device=device, hooks=hooks, model_sizes=sizes,
            components=components, listeners=listeners, pipeline=pipeline, batching=batching, gateway=gateway,
            metrics=metrics, admin=admin, server=server, shadow=shadow, layout_health=layout_health, health=health,
            parts=parts.pop_all())  # last: the running stack holds the stops from here on

    def _traced(self) -> tuple[Sequence[Hook], Any]:
        """The hooks as run, and the GenAI spans: with the installed tracing's (spans with the
        same names in every layout, and a GenAI span per model call), else as given and None."""
        from runtime.observability.tracing import installed

        tracing = installed()
        if tracing is None:
            return self.hooks, None
        from runtime.observability.genai_spans import GenAiSpans

        return [*self.hooks, tracing.hook(self.layout)], GenAiSpans(tracing.tracer)
