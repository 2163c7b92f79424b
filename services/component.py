"""What a component of the spine is: how to build, serve, reach and call it (`ComponentSpec`),
another service's API it also speaks (`ForeignApi`), and the config sections they are built
from (`ComponentConfig`). The table of the components themselves is `services.registry`.

What builds a servicer (`factory`, a foreign API's server) is a function that imports the
servicer's module when it is called; what serves or reaches one (`register`, a foreign API's
client) is named as a "module:attribute" string, resolved when used: those modules import
the model (torch) or crypto libraries, and a process imports only what it serves.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, Never, TypeVar

import grpc
from google.protobuf import descriptor as pb_descriptor

from services.auth.config import AuthConfig
from services.cache.config import CacheConfig
from services.common import DeviceState
from services.common.config_section import Section
from services.inference.config import InferenceConfig
from services.logs.config import LogsConfig
from services.metrics.config import MetricsConfig
from services.pipeline.interface import Interface, Placed
from services.pipeline.step import FailMode, Step, StepPolicy
from services.ratelimit.config import RateLimitConfig
from services.router.config import RouterConfig

PLACEMENTS: tuple[str, ...] = ("local", "remote")
Placement = Literal["local", "remote"]


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


T = TypeVar("T")  # a component's interface (`services/<name>/api.py`), e.g. `Auth`

# What builds a servicer that implements the interface `T`: from the whole config's component
# sections, the device it keeps its state on, and the run directory (where files it writes go).
Factory = Callable[[ComponentConfig, DeviceState, Path], T]


@dataclass(frozen=True)
class ComponentSpec(Generic[T]):
    """How to build, serve, reach and call one component whose interface is `T`.

    The factory returns a `T` and the steps are `Step[T]`, so the type checker holds the
    servicer to its interface where the table is written: a servicer that lacks an
    operation its steps call is refused there, not by a test at run time."""

    name: str  # also its config section and its process name in the layered layout
    proto_module: str  # e.g. "wire.v1.auth_pb2"
    service: str  # the service's name in the proto, e.g. "Auth"
    factory: Factory[T]  # builds the servicer
    config: type[Section] | None  # its config section's model (None: no section of its own)
    steps: tuple[type[Step[T]], ...]  # the pipeline steps that call it (their order: the registry's path)
    fail_mode: FailMode = FailMode.CLOSED
    budget_ms: float = 250.0  # the default call budget of its steps
    middleware: bool = True  # False for the model: placed, but not migrated as a middleware
    # Codes it answers with that reach the client as they are (a fail-closed component's
    # own verdicts); any other failure of a fail-closed component is UNAVAILABLE.
    passes: frozenset[grpc.StatusCode] = frozenset()
    # "module:function" adding the servicer to a server, when the generated one will not do.
    register: str = ""
    # Other services' APIs it also answers and can be reached through (Envoy's).
    foreign: tuple[ForeignApi[T], ...] = ()
    # Where `placements:` puts it when the config leaves it out.
    placement: Placement = "remote"

    @property
    def interface(self) -> Interface[T] | None:
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

    def build(self, config: ComponentConfig, device: DeviceState, run_dir: Path) -> T:
        return self.factory(config, device, run_dir)

    def policy(self, budget_ms: float | None = None) -> StepPolicy:
        budget_s = (self.budget_ms if budget_ms is None else budget_ms) / 1000.0
        return StepPolicy(self.name, self.fail_mode, budget_s, self.passes)


@dataclass(frozen=True)
class ForeignApi(Generic[T]):
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
    client: Callable[[grpc.Channel, Mapping[str, Any], ComponentConfig], T]

    def served(self) -> ComponentSpec[Never]:
        """What a server registers (the service, its health and reflection names)."""
        return ComponentSpec(self.protocol, self.proto_module, self.service, no_factory, None, ())

    def build_server(self, config: ComponentConfig, placed: Placed, budget_s: float) -> object:
        return self.server(config, placed, budget_s)

    def build_client(self, channel: grpc.Channel, options: Mapping[str, Any], config: ComponentConfig) -> T:
        return self.client(channel, options, config)


def no_factory(config: ComponentConfig, device: DeviceState, run_dir: Path) -> Never:
    raise TypeError("a foreign API is served by its component's servicer, never built on its own")
