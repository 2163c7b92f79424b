"""Bring up a layout: remote components as supervised processes, local ones in-process.

The front (the Gateway) always runs in this process. Each component is bound either
locally (its servicer built here on the shared `DeviceContext`, called directly) or
remotely (a child process behind a gRPC server on a unix socket). All local, it is the
spine; all remote, it is the layered stack; anything between is a migration stage.

With `batching.enabled`, whatever is local is also batched: admission (auth, ratelimit,
router and cache all local) and completion (metrics and logs local) are decided per
micro-batch (`monolith.batched`) instead of one call per request.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from monolith.batched import BatchedAdmission, BatchingConfig, DeferredCompletions
from monolith.device_on_use import DeviceOnFirstUse
from runtime.bindings import BindingHook, LocalBinding
from runtime.config import internal_key, layout_name
from runtime.config_model import check_config
from runtime.foreign import EnvoyApiHealth, ForeignBinding, envoy_apis, foreign_endpoints
from runtime.gateway_health import ComponentHealth, GatewayHealth, Target, always_serving
from runtime.outlier import OutlierDetector, OutlierPolicy
from runtime.remote_binding import RemoteBinding, remote_channel
from runtime.run_dir import write_private
from runtime.sections import TlsConfig
from runtime.server import RunningServer, request_pool, start_server
from runtime.supervisor import Supervisor
from services.common import ConfigError, section
from services.gateway.service import DirectAdmission, DirectCompletions, Gateway
from services.inference.config import InferenceConfig
from services.inference.output_policy import OutputPolicy
from services.inference.priority import DEFAULT as DEFAULT_PRIORITY
from services.pipeline.limits import RequestLimits
from services.pipeline.runner import Pipeline
from services.pipeline.state import RequestState
from services.registry import DEFAULT, GATEWAY, Registry, close_servicer

if TYPE_CHECKING:  # torch is imported only where a component allocates a tensor
    from monolith.device import DeviceContext

log = logging.getLogger("runtime")


def _down(reason: str) -> Callable[[], tuple[bool, str]]:
    return lambda: (False, reason)


@dataclass
class Stack:
    """One running layout, given a placement for every component."""

    config: Mapping[str, Any]
    placements: Mapping[str, str]
    listen: str = "127.0.0.1:0"
    run_dir: Path | None = None
    allow_external: bool = False
    hooks: Sequence[BindingHook] = ()
    # A plaintext listener answering health alone, for Kubernetes' grpc probes (they cannot
    # speak TLS): `spine up --probe-listen`.
    probe_listen: str | None = None
    # Components already served elsewhere (e.g. the layered stack's children, which a spine
    # in mid-migration shares): bound remotely to these addresses instead of spawned.
    remote_addresses: Mapping[str, str] = field(default_factory=dict)
    registry: Registry = DEFAULT
    # Made at start from the config's `device` section, the real context (and torch) on
    # first use: a stack with every component remote (the layered gateway) never makes one,
    # and never imports torch (its stages live apart from the servicers that keep tensors).
    device: DeviceContext | DeviceOnFirstUse | None = None  # or one the caller shares
    supervisor: Supervisor | None = None
    server: RunningServer | None = None
    gateway: Gateway | None = None
    pipeline: Pipeline | None = None
    local_servicers: dict[str, Any] = field(default_factory=dict)
    bindings: dict[str, Any] = field(default_factory=dict)
    metrics_endpoint: Any = None
    inference_metrics: Any = None  # the model's own /metrics, when the metrics component is remote
    deep_health: Any = None  # the local model's (runtime.health.DeepHealth)
    health: GatewayHealth | None = None  # the gateway's, from every component's
    # How often the gateway asks each remote component's health, and how long it waits: a
    # component that stops answering turns the gateway NOT_SERVING within the interval plus
    # two deadlines (a late answer is asked again once).
    health_interval_s: float = 0.5
    health_timeout_s: float = 0.5
    admission: BatchedAdmission | None = None
    completions: DeferredCompletions | None = None
    shadow: Any = None  # the spine's own mirror, with shadow.layered_address (runtime.gateway_mirror)
    _retired: list[Any] = field(default_factory=list)
    _tmp: Any = None
    _batching: BatchingConfig = field(default_factory=BatchingConfig)
    _budgets_ms: dict[str, float] = field(default_factory=dict)
    _outlier: OutlierPolicy = field(default_factory=OutlierPolicy)
    _detectors: dict[str, OutlierDetector] = field(default_factory=dict)
    # Envoy's APIs (ext_authz, rate limit service) on a second listener (`envoy_api.listen`).
    envoy_server: RunningServer | None = None
    _envoy_health: EnvoyApiHealth | None = None
    # Components `placements:` binds to services the team already runs (their protocol, not ours).
    _foreign: dict[str, Any] = field(default_factory=dict)
    # `tls:`: every TCP listener here speaks TLS and every TCP link to a component is mTLS.
    tls: TlsConfig | None = None
    # The OpenAI/Anthropic-compatible HTTP API (`runtime.http`) in front of the same
    # gateway, on this address (None: none). `spine up` passes `--http-listen` or `http.listen`.
    http_listen: str | None = None
    http_server: Any = None
    _http_app: Any = None

    @property
    def layout(self) -> str:
        return layout_name(self.placements)

    @property
    def address(self) -> str:
        assert self.server is not None, "stack not started"
        return self.server.address

    def start(self) -> str:
        """Start everything and return the Gateway's address once all is SERVING."""
        checked: Any = check_config(self.config, self.registry)  # every section, before anything starts
        self._foreign = foreign_endpoints(checked)
        self.tls = checked.tls
        calls = checked.calls
        self._budgets_ms = {name: ms for name, ms in calls.budgets_ms.model_dump().items() if ms is not None}
        self._outlier = OutlierPolicy(calls.eject_after_failures, calls.ejection_ms / 1000.0,
                                      calls.max_ejection_ms / 1000.0)
        if self.run_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="spine-")
            self.run_dir = Path(self._tmp.name)
        config_path = write_private(self.run_dir, "config.yaml", yaml.safe_dump(dict(self.config)))
        limits = RequestLimits.from_config(self.config)
        envoy_listen = checked.envoy_api.listen
        self._batching = BatchingConfig.from_config(self.config)
        if self.device is None:
            self.device = DeviceOnFirstUse(self.config)
        from runtime.tracing import installed

        tracing = installed()
        if tracing is not None:  # spans with the same names in every layout
            self.hooks = [*self.hooks, tracing.hook(self.layout)]
        try:
            remote = [name for name in self.registry.names
                      if self.placements[name] == "remote" and name not in self.remote_addresses
                      and name not in self._foreign]
            if remote:
                self.supervisor = Supervisor(self.run_dir)
                for name in remote:
                    self.supervisor.add_component(name, config_path)
                self.supervisor.start()
            for name in self.registry.names:
                self.bindings[name] = self._bind(name, limits.max_message_bytes)
            self.pipeline = Pipeline(self.registry.stages(limits, self._budgets_ms), self.bindings, hooks=self.hooks)
            self.gateway = Gateway(self.pipeline, limits, self.layout, internal_key=internal_key(self.config),
                                   policy=OutputPolicy.from_config(self.config))
            self._attach_batching()
            if "metrics" in self.local_servicers:
                from runtime.metrics_endpoint import start_metrics_endpoint

                # The rate limiter's shared-store families: from the one built here, whenever
                # it was (it leases while it exists), else from the run directory's own process.
                self.metrics_endpoint = start_metrics_endpoint(self.local_servicers["metrics"], self.config,
                                                               self.run_dir, self._local_inference,
                                                               lambda: self.local_servicers.get("ratelimit"))
            elif "inference" in self.local_servicers:  # the metrics component is elsewhere
                from runtime.serving_metrics import serve_inference_metrics

                self.inference_metrics = serve_inference_metrics(self.local_servicers["inference"], self.config,
                                                                 self.run_dir)
            envoy = self._envoy_apis()
            self.server = start_server([(GATEWAY, self.gateway), *(envoy if envoy_listen is None else [])],
                                       self.listen, max_message_bytes=limits.max_message_bytes,
                                       allow_external=self.allow_external, tls=self.tls,
                                       probe_listen=self.probe_listen, **request_pool(self.config))
            if envoy and envoy_listen is not None:
                self.envoy_server = start_server(envoy, envoy_listen, max_message_bytes=limits.max_message_bytes,
                                                 allow_external=self.allow_external, tls=self.tls)
            if envoy:  # each Envoy API is as healthy as its component (below, on every flip)
                self._envoy_health = EnvoyApiHealth(self.registry, self.envoy_server or self.server,
                                                    own_listener=self.envoy_server is not None)
            self._start_http()
            from runtime.gateway_mirror import start_gateway_mirror

            self.shadow = start_gateway_mirror(self.config, self.gateway, self.server.address,
                                               self.local_servicers.get("metrics"))
            self._start_deep_health()
            # The gateway is SERVING only while every fail-closed component is: the front,
            # xDS endpoints, the A/B tool and load balancers all read this.
            self.health = GatewayHealth(self.server, self.registry, self._health_targets,
                                        interval_s=self.health_interval_s, timeout_s=self.health_timeout_s,
                                        on_flip=self._component_flipped).start()
        except BaseException:
            self.stop()
            raise
        log.info("%s layout serving on %s", self.layout, self.server.address)
        return self.server.address

    def _start_http(self) -> None:
        if self.http_listen is None:
            return
        from runtime.http.server import start_http

        gateway = self.gateway
        assert gateway is not None
        self.http_server, self._http_app = start_http(
            gateway, self.config, self.http_listen, layout=lambda: gateway.layout,
            serving=lambda: self.health is None or self.health.serving is not False,
            tls=self.tls, allow_external=self.allow_external)

    @property
    def http_address(self) -> str | None:
        return None if self.http_server is None else self.http_server.address

    def _envoy_apis(self) -> list[tuple[Any, Any]]:
        """Envoy's APIs for the components that have one, answered by each one's binding as placed
        at the time of each call (see `runtime.foreign`)."""
        budgets_s = {name: ms / 1000.0 for name, ms in self._budgets_ms.items()}
        return envoy_apis(self.registry, self.config, lambda name: self.bindings[name], budgets_s)

    def _start_deep_health(self) -> None:
        """The local model's deep health: it can run a tiny forward on its device in time.
        It publishes nothing itself; the gateway's health reads it and hears of each change."""
        if self.deep_health is not None or "inference" not in self.local_servicers or self.server is None:
            return
        from runtime.health import start_deep_health

        inference = InferenceConfig.from_dict(section(self.config, "inference"))
        self.deep_health = start_deep_health(
            self.server, self.local_servicers["inference"], inference.health_interval_s,
            inference.health_timeout_s, services=(), on_change=self._local_health_changed)

    def _component_flipped(self, name: str, state: ComponentHealth) -> None:
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
        if self._envoy_health is not None:
            self._envoy_health.flip(name, state.serving)

    def _local_health_changed(self) -> None:
        if self.health is not None:
            self.health.refresh()

    def _health_targets(self) -> dict[str, Target]:
        """What the gateway's health looks at for each component, where it is placed now."""
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
            elif name == "inference" and self.deep_health is not None:
                targets[name] = self._model_health
            elif (check := getattr(self.local_servicers.get(name), "local_health", None)) is not None:
                targets[name] = check  # e.g. the rate limiter's shared store: leasing or falling back
            else:
                targets[name] = always_serving
        return targets

    def _model_health(self) -> tuple[bool, str]:
        deep = self.deep_health
        if deep is None:
            return True, "local"
        return deep.serving is True, deep.reason

    def health_report(self) -> dict[str, Any]:
        """The gateway's health, each component's, and each child's state (restarts, crash loops)."""
        report = self.health.report() if self.health is not None else {"serving": None, "components": {}}
        if self.supervisor is not None:
            report["children"] = self.supervisor.status()
        return report

    def local_servicer(self, name: str) -> Any:
        """The servicer `name` runs on when placed here: built once on the stack's device
        (also before it is moved here, so it can be set up first), then kept across moves."""
        assert self.run_dir is not None and self.device is not None, "stack not started"
        servicer = self.local_servicers.get(name)
        if servicer is None:
            servicer = self.registry[name].build(self.config, self.device, self.run_dir)
            self.local_servicers[name] = servicer
        return servicer

    def _bind(self, name: str, max_message_bytes: int, placement: str | None = None) -> Any:
        spec = self.registry[name]
        if (placement or self.placements[name]) == "local":
            return LocalBinding(name, spec.descriptor(), self.local_servicer(name), self.hooks)
        if name in self._foreign:
            return self._bind_foreign(name, max_message_bytes)
        if name in self.remote_addresses:
            address = self.remote_addresses[name]
        else:
            assert self.supervisor is not None, f"{name} has no process to reach"
            address = self.supervisor.children[name].address
        channel = remote_channel(address, max_message_bytes, self.tls)
        detector = self._detectors.get(name)
        if detector is None:  # one per component, kept across moves: its record is the component's
            budget_s = self._budgets_ms.get(name, spec.budget_ms) / 1000.0
            detector = self._detectors[name] = OutlierDetector(name, self._outlier, budget_s)
        return RemoteBinding(name, spec.descriptor(), spec.stub_class(), channel, self.hooks, outlier=detector)

    def _bind_foreign(self, name: str, max_message_bytes: int) -> ForeignBinding:
        """A service the team already runs, spoken to in its protocol (`placements: {remote, protocol}`)."""
        spec, endpoint = self.registry[name], self._foreign[name]
        detector = self._detectors.get(name)
        if detector is None:
            budget_s = self._budgets_ms.get(name, spec.budget_ms) / 1000.0
            detector = self._detectors[name] = OutlierDetector(name, self._outlier, budget_s)
        return ForeignBinding(spec, endpoint, self.config, remote_channel(endpoint.remote, max_message_bytes),
                              self.hooks, outlier=detector, health_timeout_s=self.health_timeout_s)

    def set_placements(self, placements: Mapping[str, str]) -> None:
        """Move components between local and remote without a restart.

        Each swap is one assignment in the pipeline's table of clients: a request already
        past that stage is unaffected; the next one uses the new binding. A component moved
        back to remote keeps its local servicer (and state) for the next move. Answers
        handed over to the old placement are written there first.
        """
        assert self.gateway is not None, "stack not started"
        limits = RequestLimits.from_config(self.config)
        merged = self.check_placements(placements)
        if self.completions is not None and merged != dict(self.placements):
            self.completions.drain()
        for name in self.registry.names:
            if merged[name] == self.placements[name]:
                continue
            old = self.bindings[name]
            self.bindings[name] = self._bind(name, limits.max_message_bytes, merged[name])
            self._retired.append(old)  # closed at stop(): in-flight calls on it finish first
        self.placements = merged
        self.gateway.layout = self.layout
        self._attach_batching()
        self._start_deep_health()  # the model moved here: the gateway's health reads its probe

    def check_placements(self, placements: Mapping[str, str]) -> dict[str, str]:
        """The placements after `placements` would be applied, or ConfigError naming the first
        one this stack cannot take (an unknown component, a value other than local|remote, a
        remote one it has no address for); nothing is changed either way."""
        merged = dict(self.placements)
        for name, placement in placements.items():
            if name not in self.registry.names:
                raise ConfigError(f"placements.{name}: unknown component; this spine has "
                                  f"{', '.join(self.registry.names)}")
            if placement not in ("local", "remote"):
                raise ConfigError(f"placements.{name}: must be local or remote, got {placement!r}")
            reachable = name in self.remote_addresses or name in self._foreign or (
                self.supervisor is not None and name in self.supervisor.children)
            if placement == "remote" and self.placements[name] != "remote" and not reachable:
                raise ConfigError(f"placements.{name}: remote, but this spine has no {name} process to call "
                                  f"(give it remote_addresses.{name} in its config)")
            merged[name] = placement
        return merged

    def _attach_batching(self) -> None:
        """Batch the stages whose components are local now (or all, with batching.remote);
        the others go per request."""
        gateway, pipeline = self.gateway, self.pipeline
        assert gateway is not None and pipeline is not None
        batching = self._batching
        batched_admission = all(batching.batches(self.placements[stage.component])
                                for stage in pipeline.admission if stage.component)
        if batched_admission:
            if self.admission is None:
                self.admission = BatchedAdmission(pipeline, batching, expected=lambda: gateway.in_flight,
                                                  patient=self._model_backlogged)
            gateway.admission = self.admission
        else:
            if self.admission is not None:
                self.admission.close()  # requests already inside finish there
                self.admission = None
            gateway.admission = DirectAdmission(pipeline)
        deferred = frozenset(stage.name for stage in pipeline.completion
                             if stage.deferrable and batching.batches(self.placements[stage.component]))
        if self.completions is not None and {s.name for s in self.completions.deferred} != deferred:
            self._close_completions()  # what it holds is written where it was meant to go
        if deferred and self.completions is None:
            self.completions = DeferredCompletions(
                pipeline, deferred, interval_s=batching.completion_interval_ms / 1000.0,
                busy=lambda: gateway.in_flight > 0)
            metrics = self.local_servicers.get("metrics")
            if metrics is not None:  # a scrape counts what was handed over first
                metrics.read_hooks.add(self.completions.drain)
        gateway.completions = self.completions if self.completions is not None else DirectCompletions(pipeline)

    def _close_completions(self) -> None:
        if self.completions is None:
            return
        self.completions.close()
        metrics = self.local_servicers.get("metrics")
        if metrics is not None:
            metrics.read_hooks.remove(self.completions.drain)
        self.completions = None

    def drain(self) -> None:
        """Write what finished requests handed over (before reading metrics, logs or the cache)."""
        if self.completions is not None:
            self.completions.drain()

    def _model_backlogged(self, states: Sequence[RequestState]) -> bool:
        """Whether admission may wait to batch more requests: only while the models these
        requests name run here with a full batch queued, so admitted a few ms later they
        lose no model time — and never for the latency class, which the model's queue lets
        ahead of that backlog."""
        inference = self._local_inference()
        if inference is None:
            return False
        models = set()  # one pass: the batcher asks this several times per request under load
        for state in states:
            request = state.request
            if request.priority > DEFAULT_PRIORITY:
                return False
            models.add(request.model)
        return bool(inference.backlogged(models))

    def _local_inference(self) -> Any:
        """The model's servicer while it runs in this process (what /metrics reads it from)."""
        return self.local_servicers.get("inference") if self.placements.get("inference") == "local" else None

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
        if self.health is not None:
            self.health.stop()
            self.health = None
        if self.deep_health is not None:
            self.deep_health.stop()
            self.deep_health = None
        if self.http_server is not None:  # its in-flight requests finish on the gateway below
            self.http_server.stop(grace)
            self.http_server = None
        if self._http_app is not None:
            self._http_app.close()
            self._http_app = None
        if self.server is not None:
            self.server.stop(grace)
            self.server = None
        if self.envoy_server is not None:
            self.envoy_server.stop(grace)
            self.envoy_server = None
        if self.admission is not None:
            self.admission.close()
            self.admission = None
        self._close_completions()
        self._write_final_metrics()
        for endpoint in (self.metrics_endpoint, self.inference_metrics):
            if endpoint is not None:
                endpoint.stop()
        self.metrics_endpoint = self.inference_metrics = None
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
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def _write_final_metrics(self) -> None:
        """The last Prometheus text, written at shutdown to run_dir/metrics.prom (nothing counted is lost)."""
        metrics = self.local_servicers.get("metrics")
        if metrics is None or self.run_dir is None:
            return
        try:
            (self.run_dir / "metrics.prom").write_text(metrics.render())
        except OSError as error:
            log.warning("could not write the final metrics to %s: %s", self.run_dir / "metrics.prom", error)

    def __enter__(self) -> Stack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
