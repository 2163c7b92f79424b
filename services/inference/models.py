"""Several models in one inference component: each its own engine, KV pool, scheduler and hint.

The simplest shape that gives each model what serving it needs: one `InferenceService` per
model (`inference` and each block of `inference.models`), all in the one inference
component, so both layouts serve every model with no new component, placement or process —
the layered inference process holds them all, as does the spine. A request goes to the
service of the model it names (the router's resolved id); each service has its own
continuous batching loop and KV slot pool (both charged to the process's one device
budget), so a flood on one model fills its own queue, not the other's, and each answer's
`x-spine-load` is its own model's.

`MultiModelInference` is the first model's service (every attribute a caller of a
single-model service reads — `engine`, `scheduler`, `config`, `load_report()` — is the
first model's) that also serves the others; `served` names them all.

A router model with `upstream:` is served here too, by calling its upstream server
(`services.inference.upstream`): `upstreams` holds them, and a request for one goes there
instead of to an engine (and, where the caller is on an event loop, awaited there:
`generate_on_loop`, `generate_stream_on_loop`). The process's health is its own models'; an upstream that is down
is that upstream's requests' error, never the process's.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator, Mapping
from typing import Any

import grpc

from services.common import ConfigError, DeviceState
from services.common.tenant_shares import TenantShares
from services.common.upstream_config import UpstreamSpec
from services.inference.api import AsyncChunkStream, Generated
from services.inference.config import InferenceConfig
from services.inference.model.backend import ModelBackend
from services.inference.model.interface import torch_device
from services.inference.service import InferenceService
from services.inference.serving_metrics import ModelGauges, ServingStats
from services.pipeline.interface import NO_OPTIONS, CallOptions
from services.pipeline.local_call import call_stream_on_loop, call_unary_on_loop
from wire.v1 import generation_pb2, inference_pb2


class MultiModelInference(InferenceService):
    """The first model's service, and one more service per further model it serves."""

    def __init__(self, config: InferenceConfig, device: DeviceState, *,
                 backend: ModelBackend | None = None, clock: Any = time.monotonic,
                 upstreams: Mapping[str, UpstreamSpec] | None = None, shares: TenantShares | None = None) -> None:
        super().__init__(config, device, backend=backend, clock=clock, shares=shares)
        self.others: dict[str, InferenceService] = {}
        self.upstreams: Any = None
        try:
            for model in config.models:
                self.others[model.model_id] = InferenceService(model, device, clock=clock, shares=shares)
            if upstreams:
                clash = sorted(set(upstreams) & set(self.served))
                if clash:
                    raise ConfigError(f"router.models: {', '.join(clash)} has an `upstream:` and is also an "
                                      "inference model; serve each model one way")
                from services.inference.upstream.service import UpstreamModels

                self.upstreams = UpstreamModels(upstreams)
                self.serving_collector.also(self.upstreams.collector)  # on the same /metrics, every layout
        except BaseException:
            self.close()
            raise

    @property
    def served(self) -> dict[str, InferenceService]:
        """Every model served here, by id, the first one first."""
        return {self.config.model_id: self, **self.others}

    def backlogged(self, models: Collection[str]) -> bool:
        """Each of `models` is served here and has a full batch waiting (a request for an idle
        model, or one not served here, must not wait)."""
        for model in models:  # without building `served`: the batcher asks this often
            service = self if model == self.config.model_id else self.others.get(model)
            if service is None or not InferenceService.backlogged(service, (model,)):
                return False
        return True

    def serving_state(self) -> list[tuple[ModelGauges, ServingStats]]:
        """Every served model's gauges and stats: one /metrics, a `model` label each."""
        return [state for service in self.served.values() for state in InferenceService.serving_state(service)]

    def _service(self, model: str, context: Any) -> Any:
        service = self.served.get(model)
        if service is None and self.upstreams is not None and model in self.upstreams:
            return self.upstreams
        if service is None:
            names = [*self.served, *(self.upstreams.endpoints if self.upstreams is not None else ())]
            context.set_trailing_metadata(self._load_metadata())
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"model {model!r} is not served here; this process serves {', '.join(map(repr, names))}")
            raise AssertionError("context.abort returned")
        return service

    # -- on the caller's event loop -----------------------------------------------------------
    def on_loop(self, model: str) -> bool:
        """Whether `model`'s answer can be awaited on the caller's event loop: an upstream's
        (network I/O on that loop's connections); a model served here holds a thread while
        its engine works, so it is called as `generate`."""
        return self.upstreams is not None and model in self.upstreams and model not in self.served

    async def generate_on_loop(self, request: generation_pb2.GenerateRequest,
                               options: CallOptions = NO_OPTIONS) -> Generated:
        """`generate` for a model `on_loop` names, awaited on the caller's loop, same rules."""
        response, trailing = await call_unary_on_loop(self.upstreams.generate_on_loop, request, options)
        return Generated(response, trailing)

    def generate_stream_on_loop(self, request: generation_pb2.GenerateRequest,
                                options: CallOptions = NO_OPTIONS) -> AsyncChunkStream:
        """`generate_stream` for a model `on_loop` names, read on the caller's loop, same rules."""
        return call_stream_on_loop(self.upstreams.generate_stream_on_loop, request, options)

    # -- gRPC: each request to its model's service ------------------------------------------
    def Generate(self, request: generation_pb2.GenerateRequest, context: Any) -> generation_pb2.GenerateResponse:
        service = self._service(request.model, context)
        if service is self:
            return super().Generate(request, context)
        answer: generation_pb2.GenerateResponse = service.Generate(request, context)
        return answer

    def GenerateStream(self, request: generation_pb2.GenerateRequest,
                       context: Any) -> Iterator[generation_pb2.GenerateChunk]:
        service = self._service(request.model, context)
        if service is self:
            yield from super().GenerateStream(request, context)
        else:  # closing this generator closes the model's (its slot is freed)
            yield from service.GenerateStream(request, context)

    def Models(self, request: inference_pb2.ModelInfoRequest, context: Any) -> inference_pb2.ModelInfoResponse:
        context.set_trailing_metadata(self._load_metadata())
        upstream = [inference_pb2.ModelInfo(id=model_id, device="upstream")
                    for model_id in (self.upstreams.endpoints if self.upstreams is not None else ())]
        return inference_pb2.ModelInfoResponse(models=[
            *(inference_pb2.ModelInfo(id=model_id, max_context=service.backend.max_context,
                                      device=str(torch_device(service.device)), load=service.load_report().header())
              for model_id, service in self.served.items()), *upstream])

    # -- the process's health and life: every model's ---------------------------------------
    def health_probe(self) -> None:
        super().health_probe()
        for service in self.others.values():
            service.health_probe()

    def close(self) -> None:
        if getattr(self, "upstreams", None) is not None:
            self.upstreams.close()
        for service in reversed(list(getattr(self, "others", {}).values())):
            service.close()
        super().close()

