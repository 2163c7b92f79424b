"""The Router service: a model id or alias becomes (canonical model id, backend).

A model may name a `fallback` (a smaller model a client may use while this one is
overloaded); the answer says which, and which models a fallback stands in for, so the
gateway can tell the client (`x-spine-fallback`, `x-spine-primary-load`).

Names are checked at load so that every name resolves to exactly one model: a duplicate id
or alias, or an alias that shadows another model's id, is a ConfigError, never a silent
"last one wins". `ResolveBatch` routes many requests at once (the pipeline's router step
calls it in either layout); the per-request `Resolve` is its batch of one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from services.common import DeviceState
from services.pipeline.batch_rpc import ItemError
from services.pipeline.interface import NO_OPTIONS, CallOptions
from services.router.api import RESOLVE_BATCH
from services.router.config import ModelRoute, RouterConfig
from wire.v1 import router_pb2, router_pb2_grpc

_MAX_ECHO = 64  # an unknown name is quoted back, but not an arbitrarily long one


class UnknownModel(LookupError):
    """No model by that name; the message lists the known ids and aliases."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown model"


class RouterService(router_pb2_grpc.RouterServicer):
    def __init__(self, config: RouterConfig, device: DeviceState | None = None) -> None:
        self.config = config
        self.device = device  # the router keeps no tensor state; accepted for a uniform constructor
        self._routes: dict[str, ModelRoute] = {}
        for model in config.models:
            self._routes[model.id] = model
            for alias in model.aliases:
                self._routes[alias] = model
        self._known = "; ".join(
            f"{m.id} (aliases: {', '.join(m.aliases)})" if m.aliases else m.id for m in config.models
        )
        # Which model stands in for which while it is overloaded (`fallback:`), both ways.
        self._fallback = config.fallback_ids()
        self._fallback_of: dict[str, list[str]] = {}
        for primary, fallback in self._fallback.items():
            self._fallback_of.setdefault(fallback, []).append(primary)
        # Every name's route, made once (the table is fixed at start) and shared read-only.
        self._answers = {name: self._answer(name, model) for name, model in self._routes.items()}

    def route(self, name: str) -> router_pb2.ResolveResponse:
        """The model `name` (an id or alias) routes to; UnknownModel (a LookupError) if none."""
        route = self._route(name)
        if isinstance(route, ItemError):
            raise UnknownModel(route.message)
        answer = router_pb2.ResolveResponse()
        answer.CopyFrom(route)
        return answer

    def resolve(self, names: Sequence[str], options: CallOptions = NO_OPTIONS) -> list[router_pb2.ResolveResponse | ItemError]:
        """One route per name, in order; an unknown name is that item's NOT_FOUND. The
        routes are shared, read-only objects: copy one before changing it."""
        return [self._route(name) for name in names]

    def _route(self, name: str) -> router_pb2.ResolveResponse | ItemError:
        answer = self._answers.get(name)
        if answer is not None:
            return answer
        if not name:
            return ItemError(grpc.StatusCode.NOT_FOUND, f"no model requested; known: {self._known}")
        shown = name if len(name) <= _MAX_ECHO else name[:_MAX_ECHO] + "..."
        return ItemError(grpc.StatusCode.NOT_FOUND, f"unknown model {shown!r}; known: {self._known}")

    def _answer(self, name: str, model: ModelRoute) -> router_pb2.ResolveResponse:
        return router_pb2.ResolveResponse(model_id=model.id, backend=model.served_by, requested=name,
                                          fallback=self._fallback.get(model.id, ""),
                                          fallback_of=self._fallback_of.get(model.id, ()))

    def list_models(self) -> router_pb2.ListModelsResponse:
        return router_pb2.ListModelsResponse(
            model_ids=[m.id for m in self.config.models],
            aliases={alias: m.id for m in self.config.models for alias in m.aliases},
            fallbacks=self._fallback,
        )

    def ResolveBatch(self, request: router_pb2.ResolveBatchRequest,
                     context: Any = None) -> router_pb2.ResolveBatchResponse:
        """`resolve` over the wire: an unknown model is that item's NOT_FOUND."""
        return RESOLVE_BATCH.serve(self, request, context)

    def ListModels(
        self, request: router_pb2.ListModelsRequest, context: grpc.ServicerContext
    ) -> router_pb2.ListModelsResponse:
        return self.list_models()

