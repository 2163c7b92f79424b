"""The component table: every middleware and the model, in pipeline order, in one place.

Adding a middleware touches its proto, one service module and this table. Each entry
knows how to build its servicer from the config, how to put it on a gRPC server, and
which stub reaches it over the wire — everything a binding needs, nothing about layout.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf import descriptor as pb_descriptor

from services.common import DeviceState

MIDDLEWARES: tuple[str, ...] = ("auth", "ratelimit", "router", "cache", "metrics", "logs")
COMPONENTS: tuple[str, ...] = (*MIDDLEWARES, "inference")
PLACEMENTS: tuple[str, ...] = ("local", "remote")

# Fail closed: without them a request must not be served. Fail open: a request goes on
# without them and the failure is counted.
FAIL_CLOSED: frozenset[str] = frozenset({"auth", "ratelimit", "router", "inference"})


@dataclass(frozen=True)
class ComponentSpec:
    """How to build, serve and reach one component."""

    name: str
    proto_module: str      # e.g. "spine.v1.auth_pb2"
    service: str           # service name in the proto, e.g. "Auth"
    factory: str           # "module:function" building the servicer from (config, device, run_dir)

    def descriptor(self) -> pb_descriptor.ServiceDescriptor:
        module = importlib.import_module(self.proto_module)
        return module.DESCRIPTOR.services_by_name[self.service]

    @property
    def full_name(self) -> str:
        return self.descriptor().full_name

    def _grpc_module(self) -> Any:
        return importlib.import_module(self.proto_module.removesuffix("_pb2") + "_pb2_grpc")

    def stub_class(self) -> type:
        return getattr(self._grpc_module(), f"{self.service}Stub")

    def add_to_server(self, servicer: Any, server: Any) -> None:
        getattr(self._grpc_module(), f"add_{self.service}Servicer_to_server")(servicer, server)

    def build(self, config: Mapping[str, Any], device: DeviceState, run_dir: Path) -> Any:
        module_name, function = self.factory.split(":")
        return getattr(importlib.import_module(module_name), function)(config, device, run_dir)


SPECS: dict[str, ComponentSpec] = {
    "auth": ComponentSpec("auth", "spine.v1.auth_pb2", "Auth", "services.factories:build_auth"),
    "ratelimit": ComponentSpec("ratelimit", "spine.v1.ratelimit_pb2", "RateLimit", "services.factories:build_ratelimit"),
    "router": ComponentSpec("router", "spine.v1.router_pb2", "Router", "services.factories:build_router"),
    "cache": ComponentSpec("cache", "spine.v1.cache_pb2", "Cache", "services.factories:build_cache"),
    "metrics": ComponentSpec("metrics", "spine.v1.metrics_pb2", "Metrics", "services.factories:build_metrics"),
    "logs": ComponentSpec("logs", "spine.v1.logs_pb2", "Logs", "services.factories:build_logs"),
    "inference": ComponentSpec("inference", "spine.v1.inference_pb2", "Inference", "services.factories:build_inference"),
}
GATEWAY = ComponentSpec("gateway", "spine.v1.gateway_pb2", "Gateway", "")


def close_servicer(servicer: Any) -> None:
    """Flush and stop what a servicer holds (log ring, flusher threads, model loop)."""
    close: Callable[[], None] | None = getattr(servicer, "close", None)
    if close is not None:
        close()
