"""The component table: every middleware and the model, declared once.

Adding a middleware = its proto, its package (the servicer in `service.py`, its steps in
`steps.py`, its config section in `config.py`), one entry in `DEFAULT` and its steps in
its `path`. Everything else is derived from the table: the pipeline's steps and their order, the
config sections, the span names, the list of middlewares a migration plan may move, the
children of the layered layout and the names in the Kubernetes manifests.

An entry refers to its config section and its steps directly (light modules: pydantic and
the wire types), and to the function that builds its servicer (`services.component_factories`,
which imports the servicer's module only when called). What an entry is — `ComponentSpec`,
`ForeignApi`, and `ComponentConfig`, every component's section of a spine config that a
factory reads — is `services.component`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Never, TypeVar

import grpc

from services.auth.config import AuthConfig
from services.auth.steps import AuthStep
from services.cache.config import CacheConfig
from services.cache.steps import CacheLookupStep, CacheStoreStep
from services.common.config_section import Section
from services.component import ComponentSpec, Factory, ForeignApi, Placement, no_factory
from services.component_factories import (
    auth,
    cache,
    envoy_authz,
    envoy_authz_client,
    envoy_rls,
    envoy_rls_client,
    inference,
    logs,
    metrics,
    ratelimit,
    router,
)
from services.gateway.validation import ModelAccessStep, ValidationStep
from services.inference.config import InferenceConfig
from services.inference.steps import InferenceStep
from services.logs.config import LogsConfig
from services.logs.steps import LogsStep
from services.metrics.config import MetricsConfig
from services.metrics.steps import MetricsStep
from services.pipeline.limits import RequestLimits
from services.pipeline.step import FailMode, Step, StepPolicy
from services.ratelimit.config import RateLimitConfig
from services.ratelimit.steps import RateLimitStep, ReleaseStep
from services.router.config import RouterConfig
from services.router.steps import RouterStep

T = TypeVar("T")  # a component's interface
# The steps on the path that call no component: the gateway's own checks.
GATEWAY_STEPS: tuple[type[Step[Any]], ...] = (ValidationStep, ModelAccessStep)


class Registry:
    """An ordered set of components and the request path through their steps; the default
    one is `DEFAULT`, tests may extend it."""

    def __init__(self, specs: Iterable[ComponentSpec[Any]], path: Sequence[type[Step[Any]]]) -> None:
        self._specs: dict[str, ComponentSpec[Any]] = {}
        for spec in specs:
            if spec.name in self._specs:
                raise ValueError(f"component {spec.name!r} is declared twice")
            self._specs[spec.name] = spec
        self.path = tuple(path)
        self._owner: dict[type[Step[Any]], ComponentSpec[Any]] = {cls: spec for spec in self for cls in spec.steps}
        placed = set(self.path)
        missing = [cls.__name__ for cls in self._owner if cls not in placed]
        unknown = [cls.__name__ for cls in self.path if cls not in self._owner and cls not in GATEWAY_STEPS]
        if missing or unknown or len(placed) != len(self.path):
            raise ValueError(f"the path must hold every component's steps once: missing {missing}, "
                             f"unknown {unknown}, path {[cls.__name__ for cls in self.path]}")

    def __iter__(self) -> Iterator[ComponentSpec[Any]]:
        return iter(self._specs.values())

    def __getitem__(self, name: str) -> ComponentSpec[Any]:
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

    def with_component(self, spec: ComponentSpec[Any], *, after: type[Step[Any]]) -> Registry:
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


def _spec(name: str, service: str, config: type[Section], steps: tuple[type[Step[T]], ...], factory: Factory[T], *,
          passes: tuple[grpc.StatusCode, ...] = (), fail_mode: FailMode = FailMode.CLOSED,
          budget_ms: float = 250.0, middleware: bool = True, foreign: tuple[ForeignApi[T], ...] = (),
          placement: Placement = "local") -> ComponentSpec[T]:
    return ComponentSpec(name, f"wire.v1.{name}_pb2", service, factory, config, steps,
                         fail_mode, budget_ms, middleware, frozenset(passes), foreign=foreign, placement=placement)


ENVOY_EXT_AUTHZ = ForeignApi("envoy-ext-authz", "envoy.service.auth.v3.external_auth_pb2", "Authorization",
                             envoy_authz, envoy_authz_client)
ENVOY_RLS = ForeignApi("envoy-rls", "envoy.service.ratelimit.v3.rls_pb2", "RateLimitService",
                       envoy_rls, envoy_rls_client)


_CODE = grpc.StatusCode
DEFAULT = Registry([
    _spec("auth", "Auth", AuthConfig, (AuthStep,), auth,
          passes=(_CODE.UNAUTHENTICATED, _CODE.PERMISSION_DENIED), foreign=(ENVOY_EXT_AUTHZ,), placement="remote"),
    _spec("ratelimit", "RateLimit", RateLimitConfig, (RateLimitStep, ReleaseStep), ratelimit,
          passes=(_CODE.INVALID_ARGUMENT, _CODE.RESOURCE_EXHAUSTED), foreign=(ENVOY_RLS,), placement="remote"),
    _spec("router", "Router", RouterConfig, (RouterStep,), router,
          passes=(_CODE.NOT_FOUND,)),
    _spec("cache", "Cache", CacheConfig, (CacheLookupStep, CacheStoreStep), cache, fail_mode=FailMode.OPEN),
    _spec("metrics", "Metrics", MetricsConfig, (MetricsStep,), metrics,
          fail_mode=FailMode.OPEN, budget_ms=1000.0),
    _spec("logs", "Logs", LogsConfig, (LogsStep,), logs, fail_mode=FailMode.OPEN,
          budget_ms=1000.0),
    # The model: its budget is the compute budget it enforces itself; the call is bounded
    # by the request's deadline. One component serves every configured model
    # (`inference.models`), each with its own engine, KV pool and scheduler.
    _spec("inference", "Inference", InferenceConfig, (InferenceStep,), inference,
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
GATEWAY: ComponentSpec[Never] = ComponentSpec("gateway", "wire.v1.gateway_pb2", "Gateway", no_factory, None, (),
                        register="services.gateway.wire:add_gateway_to_server")

MIDDLEWARES: tuple[str, ...] = DEFAULT.middlewares
COMPONENTS: tuple[str, ...] = DEFAULT.names


def close_servicer(servicer: Any) -> None:
    """Flush and stop what a servicer holds (log ring, flusher threads, model loop)."""
    close = getattr(servicer, "close", None)
    if close is not None:
        close()
