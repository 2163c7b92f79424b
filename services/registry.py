"""The component table: every middleware and the model, declared once.

Adding a middleware = its proto, its package (the servicer in `service.py`, its steps in
`steps.py`, its config section in `config.py`), one entry in `DEFAULT` and its steps in
its `path`. Everything else is derived from the table: the pipeline's steps and their order, the
config sections, the span names, the list of middlewares a migration plan may move, the
children of the layered layout and the names in the Kubernetes manifests.

An entry refers to its config section and its steps directly (light modules: pydantic and
the wire types). What builds a servicer (`factory`, a foreign API's server) is a function of
this module that imports the servicer's module when it is called; what serves or reaches one
(`register`, a foreign API's client) is named as a "module:attribute" string, resolved when
used: those modules import the model (torch) or crypto libraries, and a process imports only
what it serves.

`ComponentConfig` is every component's section of a spine config, typed, with its defaults
(the runtime's `SpineConfig` adds its own sections to it): a factory reads the sections it
needs from it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import grpc
from google.protobuf import descriptor as pb_descriptor

from services.auth.api import AUTH, Auth
from services.auth.config import AuthConfig
from services.auth.steps import AuthStep
from services.cache.config import CacheConfig
from services.cache.steps import CacheLookupStep, CacheStoreStep
from services.common import DeviceState
from services.common.config_section import Section
from services.common.tenant_shares import TenantShares
from services.gateway.validation import ModelAccessStep, ValidationStep
from services.inference.config import InferenceConfig
from services.inference.steps import InferenceStep
from services.logs.config import LogsConfig
from services.logs.steps import LogsStep
from services.metrics.config import MetricsConfig
from services.metrics.steps import MetricsStep
from services.pipeline.interface import Interface, Placed
from services.pipeline.limits import RequestLimits
from services.pipeline.step import FailMode, Step, StepPolicy
from services.ratelimit.api import RATELIMIT, RateLimit
from services.ratelimit.config import RateLimitConfig
from services.ratelimit.steps import RateLimitStep, ReleaseStep
from services.router.config import RouterConfig
from services.router.steps import RouterStep

if TYPE_CHECKING:  # the servicers' modules import torch or crypto: each factory imports its own when called
    from services.auth.envoy_authz import EnvoyAuthorization
    from services.auth.service import AuthService
    from services.cache.service import CacheService
    from services.inference.models import MultiModelInference
    from services.logs.service import LogsService
    from services.metrics.service import MetricsService
    from services.ratelimit.envoy_ratelimit import EnvoyRateLimit
    from services.ratelimit.service import RateLimitService
    from services.router.service import RouterService

PLACEMENTS: tuple[str, ...] = ("local", "remote")
Placement = Literal["local", "remote"]
# The steps on the path that call no component: the gateway's own checks.
GATEWAY_STEPS: tuple[type[Step[Any]], ...] = (ValidationStep, ModelAccessStep)


def _resolve(path: str) -> Any:
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


class ComponentConfig(Section):
    """Every component's section of a spine config, each with its documented defaults (the
    model's own section serves the built-in model and its smaller fallback; auth knows the
    development key). A new component's section is one more field here."""

    auth: AuthConfig = AuthConfig()
    ratelimit: RateLimitConfig = RateLimitConfig()
    router: RouterConfig = RouterConfig()
    cache: CacheConfig = CacheConfig()
    metrics: MetricsConfig = MetricsConfig()
    logs: LogsConfig = LogsConfig()
    inference: InferenceConfig = InferenceConfig()


# What builds a servicer: from the whole config's component sections, the device it keeps
# its state on, and the run directory (where files it writes go).
Factory = Callable[[ComponentConfig, DeviceState, Path], object]


@dataclass(frozen=True)
class ComponentSpec:
    """How to build, serve, reach and call one component."""

    name: str  # also its config section and its process name in the layered layout
    proto_module: str  # e.g. "wire.v1.auth_pb2"
    service: str  # the service's name in the proto, e.g. "Auth"
    factory: Factory  # builds the servicer
    config: type[Section] | None  # its config section's model (None: no section of its own)
    steps: tuple[type[Step[Any]], ...]  # the pipeline steps that call it (their order: the registry's path)
    fail_mode: FailMode = FailMode.CLOSED
    budget_ms: float = 250.0  # the default call budget of its stages
    middleware: bool = True  # False for the model: placed, but not migrated as a middleware
    # Codes it answers with that reach the client as they are (a fail-closed component's
    # own verdicts); any other failure of a fail-closed component is UNAVAILABLE.
    passes: frozenset[grpc.StatusCode] = frozenset()
    # "module:function" adding the servicer to a server, when the generated one will not do.
    register: str = ""
    # Other services' APIs it also answers and can be reached through (Envoy's).
    foreign: tuple[ForeignApi, ...] = ()
    # Where `placements:` puts it when the config leaves it out.
    placement: Placement = "remote"

    @property
    def interface(self) -> Interface[Any] | None:
        """Its interface (`services/<name>/api.py`), as its steps declare it (None: it has no step)."""
        return self.steps[0].interface if self.steps else None

    def descriptor(self) -> pb_descriptor.ServiceDescriptor:
        module = importlib.import_module(self.proto_module)
        descriptor: pb_descriptor.ServiceDescriptor = module.DESCRIPTOR.services_by_name[self.service]
        return descriptor

    @property
    def full_name(self) -> str:
        return self.descriptor().full_name

    def _grpc_module(self) -> Any:
        return importlib.import_module(self.proto_module.removesuffix("_pb2") + "_pb2_grpc")

    def stub_class(self) -> type:
        stub: type = getattr(self._grpc_module(), f"{self.service}Stub")
        return stub

    def add_to_server(self, servicer: Any, server: Any) -> None:
        if self.register:
            _resolve(self.register)(servicer, server)
        else:
            getattr(self._grpc_module(), f"add_{self.service}Servicer_to_server")(servicer, server)

    def build(self, config: ComponentConfig, device: DeviceState, run_dir: Path) -> Any:
        return self.factory(config, device, run_dir)

    def policy(self, budget_ms: float | None = None) -> StepPolicy:
        budget_s = (self.budget_ms if budget_ms is None else budget_ms) / 1000.0
        return StepPolicy(self.name, self.fail_mode, budget_s, self.passes)


@dataclass(frozen=True)
class ForeignApi:
    """Another service's API for the same decision (Envoy's ext_authz, its rate limit service).

    Both ways: every process that holds or reaches the component answers it (`server`: a
    servicer built on the component's own rpcs, wherever the component is placed), and a
    placement `{remote: HOST:PORT, protocol: <protocol>}` binds the component to a service
    the team already runs that speaks it (`client`: a stub with the component's call shape).
    """

    protocol: str  # its name in placements, e.g. "envoy-rls"
    proto_module: str  # e.g. "envoy.service.ratelimit.v3.rls_pb2"
    service: str  # the service's name in that proto, e.g. "RateLimitService"
    # (config, the components as placed at each call, its call budget in s) -> the API's servicer
    server: Callable[[ComponentConfig, Placed, float], object]
    # (channel, the placement's options, config) -> the component's interface in that protocol
    client: Callable[[grpc.Channel, Mapping[str, Any], ComponentConfig], object]

    def served(self) -> ComponentSpec:
        """What a server registers (the service, its health and reflection names)."""
        return ComponentSpec(self.protocol, self.proto_module, self.service, no_factory, None, ())

    def build_server(self, config: ComponentConfig, placed: Placed, budget_s: float) -> object:
        return self.server(config, placed, budget_s)

    def build_client(self, channel: grpc.Channel, options: Mapping[str, Any], config: ComponentConfig) -> object:
        return self.client(channel, options, config)


class Registry:
    """An ordered set of components and the request path through their steps; the default
    one is `DEFAULT`, tests may extend it."""

    def __init__(self, specs: Iterable[ComponentSpec], path: Sequence[type[Step[Any]]]) -> None:
        self._specs: dict[str, ComponentSpec] = {}
        for spec in specs:
            if spec.name in self._specs:
                raise ValueError(f"component {spec.name!r} is declared twice")
            self._specs[spec.name] = spec
        self.path = tuple(path)
        self._owner: dict[type[Step[Any]], ComponentSpec] = {cls: spec for spec in self for cls in spec.steps}
        placed = set(self.path)
        missing = [cls.__name__ for cls in self._owner if cls not in placed]
        unknown = [cls.__name__ for cls in self.path if cls not in self._owner and cls not in GATEWAY_STEPS]
        if missing or unknown or len(placed) != len(self.path):
            raise ValueError(f"the path must hold every component's steps once: missing {missing}, "
                             f"unknown {unknown}, path {[cls.__name__ for cls in self.path]}")

    def __iter__(self) -> Iterator[ComponentSpec]:
        return iter(self._specs.values())

    def __getitem__(self, name: str) -> ComponentSpec:
        return self._specs[name]

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    @property
    def names(self) -> tuple[str, ...]:
        """Every component (the layered layout runs one process each)."""
        return tuple(self._specs)

    @property
    def models(self) -> tuple[str, ...]:
        """The components that are the model (placed in the spine by default)."""
        return tuple(spec.name for spec in self if not spec.middleware)

    @property
    def middlewares(self) -> tuple[str, ...]:
        """What a migration plan moves between the layered stack and the spine."""
        return tuple(spec.name for spec in self if spec.middleware)

    @property
    def placement_fields(self) -> tuple[tuple[str, str, tuple[str, ...]], ...]:
        """Each component's `placements:` field: (name, where it runs when left out, the foreign
        protocols a placement may name for it)."""
        return tuple((spec.name, spec.placement, tuple(api.protocol for api in spec.foreign)) for spec in self)

    def with_component(self, spec: ComponentSpec, *, after: type[Step[Any]]) -> Registry:
        """This table plus one more component, its steps joining the path right after `after`."""
        at = self.path.index(after) + 1
        return Registry([*self, spec], [*self.path[:at], *spec.steps, *self.path[at:]])

    def steps(self, limits: RequestLimits, budgets_ms: Mapping[str, float] | None = None) -> list[Step[Any]]:
        """The request path: every component's steps plus the gateway's own, in `path` order."""
        budgets = budgets_ms or {}
        steps: list[Step[Any]] = []
        for cls in self.path:
            spec = self._owner.get(cls)
            policy = StepPolicy("") if spec is None else spec.policy(budgets.get(spec.name))
            steps.append(cls(policy, limits))
        return steps



def _spec(name: str, service: str, config: type[Section], steps: tuple[type[Step[Any]], ...], factory: Factory, *,
          passes: tuple[grpc.StatusCode, ...] = (), fail_mode: FailMode = FailMode.CLOSED,
          budget_ms: float = 250.0, middleware: bool = True, foreign: tuple[ForeignApi, ...] = (),
          placement: Placement = "local") -> ComponentSpec:
    return ComponentSpec(name, f"wire.v1.{name}_pb2", service, factory, config, steps,
                         fail_mode, budget_ms, middleware, frozenset(passes), foreign=foreign, placement=placement)


def no_factory(config: ComponentConfig, device: DeviceState, run_dir: Path) -> object:
    raise TypeError("a foreign API is served by its component's servicer, never built on its own")


# -- the factories: each imports its servicer's module (torch, crypto) only when called ----------
def _auth(config: ComponentConfig, device: DeviceState, run_dir: Path) -> AuthService:
    from services.auth.service import AuthService

    store = config.auth.store
    if not store.enabled:
        return AuthService(config.auth, device)
    from services.auth.key_store import open_key_store
    from services.auth.live_keys import LiveKeys

    keys, hasher = open_key_store(store, run_dir)
    return AuthService(config.auth, device, live_keys=LiveKeys(keys, hasher, store.poll_s).start())


def _ratelimit(config: ComponentConfig, device: DeviceState, run_dir: Path) -> RateLimitService:
    from services.ratelimit.service import RateLimitService

    limits = config.ratelimit
    if not limits.spend.tracked:
        return RateLimitService(limits, device)
    from services.ratelimit.spend import SpendLedger
    from services.ratelimit.spend_store import open_spend_store

    spend = SpendLedger(limits.spend, open_spend_store(limits, run_dir)).start()  # `ratelimit.spend` prices or budgets
    return RateLimitService(limits, device, spend=spend)


def _router(config: ComponentConfig, device: DeviceState, run_dir: Path) -> RouterService:
    from services.router.service import RouterService

    return RouterService(config.router, device)


def _cache(config: ComponentConfig, device: DeviceState, run_dir: Path) -> CacheService:
    from services.cache.service import build

    return build(config.cache, config.inference, device)


def _metrics(config: ComponentConfig, device: DeviceState, run_dir: Path) -> MetricsService:
    from services.metrics.service import MetricsService

    return MetricsService(config.metrics, device)


def _logs(config: ComponentConfig, device: DeviceState, run_dir: Path) -> LogsService:
    from services.logs.service import LogsService

    return LogsService(config.logs, device, run_dir=run_dir)


def _inference(config: ComponentConfig, device: DeviceState, run_dir: Path) -> MultiModelInference:
    from services.common.upstream_config import upstream_routes
    from services.inference.models import MultiModelInference

    return MultiModelInference(config.inference, device, upstreams=upstream_routes(config.router.models),
                               shares=tenant_shares(config.ratelimit))


def tenant_shares(limits: RateLimitConfig) -> TenantShares:
    """Each tenant's weight in the model's queue: its rate limit tier's `share_weight` (the
    middlewares never import each other, so the table hands it over)."""
    return TenantShares(limits.default.share_weight, {name: tier.share_weight for name, tier in limits.tenants.items()})


def _envoy_authz(config: ComponentConfig, placed: Placed, budget_s: float) -> EnvoyAuthorization:
    from services.auth.envoy_authz import EnvoyAuthorization

    return EnvoyAuthorization(lambda: placed.get(AUTH), budget_s)


def _envoy_rls(config: ComponentConfig, placed: Placed, budget_s: float) -> EnvoyRateLimit:
    from services.ratelimit.envoy_ratelimit import EnvoyRateLimit, ModelNames

    return EnvoyRateLimit(lambda: placed.get(RATELIMIT), budget_s, config.ratelimit.domain, ModelNames(config.router))


def _envoy_authz_client(channel: grpc.Channel, options: Mapping[str, Any], config: ComponentConfig) -> Auth:
    from services.auth.envoy_authz import TENANT_HEADER, EnvoyAuthzClient

    return EnvoyAuthzClient(channel, str(options.get("tenant_header") or TENANT_HEADER))


def _envoy_rls_client(channel: grpc.Channel, options: Mapping[str, Any], config: ComponentConfig) -> RateLimit:
    from services.ratelimit.envoy_ratelimit import EnvoyRlsClient

    return EnvoyRlsClient(channel, str(options.get("domain") or config.ratelimit.domain))


ENVOY_EXT_AUTHZ = ForeignApi("envoy-ext-authz", "envoy.service.auth.v3.external_auth_pb2", "Authorization",
                             _envoy_authz, _envoy_authz_client)
ENVOY_RLS = ForeignApi("envoy-rls", "envoy.service.ratelimit.v3.rls_pb2", "RateLimitService",
                       _envoy_rls, _envoy_rls_client)


_CODE = grpc.StatusCode
DEFAULT = Registry([
    _spec("auth", "Auth", AuthConfig, (AuthStep,), _auth,
          passes=(_CODE.UNAUTHENTICATED, _CODE.PERMISSION_DENIED), foreign=(ENVOY_EXT_AUTHZ,), placement="remote"),
    _spec("ratelimit", "RateLimit", RateLimitConfig, (RateLimitStep, ReleaseStep), _ratelimit,
          passes=(_CODE.INVALID_ARGUMENT, _CODE.RESOURCE_EXHAUSTED), foreign=(ENVOY_RLS,), placement="remote"),
    _spec("router", "Router", RouterConfig, (RouterStep,), _router,
          passes=(_CODE.NOT_FOUND,)),
    _spec("cache", "Cache", CacheConfig, (CacheLookupStep, CacheStoreStep), _cache, fail_mode=FailMode.OPEN),
    _spec("metrics", "Metrics", MetricsConfig, (MetricsStep,), _metrics,
          fail_mode=FailMode.OPEN, budget_ms=1000.0),
    _spec("logs", "Logs", LogsConfig, (LogsStep,), _logs, fail_mode=FailMode.OPEN,
          budget_ms=1000.0),
    # The model: its budget is the compute budget it enforces itself; the call is bounded
    # by the request's deadline. One component serves every configured model
    # (`inference.models`), each with its own engine, KV pool and scheduler.
    _spec("inference", "Inference", InferenceConfig, (InferenceStep,), _inference,
          passes=(_CODE.INVALID_ARGUMENT, _CODE.DEADLINE_EXCEEDED, _CODE.RESOURCE_EXHAUSTED, _CODE.CANCELLED,
                  _CODE.NOT_FOUND),
          budget_ms=float("inf"), middleware=False),
], path=(
    # The request path, in order: the one list that says which step runs when.
    AuthStep,  # who is asking (fail closed)
    ValidationStep,  # the gateway's own checks of the request, once its tenant is known
    RouterStep,  # which model it names
    ModelAccessStep,  # whether its key may use that model
    RateLimitStep,  # admission: tokens and a concurrency slot
    CacheLookupStep,  # a stored answer ends the request here
    InferenceStep,  # the model
    ReleaseStep,  # the concurrency slot back, before the slower completion steps
    CacheStoreStep,
    LogsStep,  # before metrics, so a failed append is counted in the request's record
    MetricsStep,
))
GATEWAY = ComponentSpec("gateway", "wire.v1.gateway_pb2", "Gateway", no_factory, None, (),
                        register="services.gateway.service:add_gateway_to_server")

MIDDLEWARES: tuple[str, ...] = DEFAULT.middlewares
COMPONENTS: tuple[str, ...] = DEFAULT.names


def close_servicer(servicer: Any) -> None:
    """Flush and stop what a servicer holds (log ring, flusher threads, model loop)."""
    close = getattr(servicer, "close", None)
    if close is not None:
        close()
