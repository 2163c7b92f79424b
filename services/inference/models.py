"""Every model of the inference component, in one router: each built-in model its own
engine, KV pool, scheduler and hint; each upstream-served model a call to its servers.

The simplest shape that gives each model what serving it needs: one `InferenceService` per
built-in model (`inference` and each block of `inference.models`), all in the one inference
component, so both layouts serve every model with no new component, placement or process —
the layered inference process holds them all, as does the spine. A request goes to the
service of the model it names (the router's resolved id); each service has its own
continuous batching loop and KV slot pool (both charged to the process's one device
budget), so a flood on one model fills its own queue, not the other's, and each answer's
`x-spine-load` is its own model's.

`ModelRouter` is a model server like each of them (`services.inference.rpcs`: its own
`answer`/`chunks`/`describe`, the `Inference` interface and the gRPC rpcs thin adapters over
them): it holds the models and hands each request to its model's, no model standing in for
the others.

A router model with `upstream:` is served here too, by calling its upstream server
(`services.inference.upstream`): `upstreams` holds them, and a request for one goes there
instead of to an engine. Where the caller is on an event loop, every model's answer is
awaited there (`generate_on_loop`, `generate_stream_on_loop`): an upstream's on that loop's
connections, a built-in model's handed to that loop once per decode step. The process's health is its own models'; an
upstream that is down is that upstream's requests' error, never the process's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Generator, Mapping
from typing import TYPE_CHECKING

import grpc
from prometheus_client.registry import CollectorRegistry

from services.common import ConfigError, DeviceState
from services.common.tenant_shares import TenantShares
from services.common.upstream_config import UpstreamSpec
from services.inference.api import AsyncChunkStream, Generated
from services.inference.config import InferenceConfig
from services.inference.gpu_metrics import GpuGoldenMetrics
from services.inference.model.backend import ModelBackend
from services.inference.rpcs import InferenceRpcs, ModelCall
from services.inference.service import InferenceService
from services.inference.serving_metrics import ModelGauges, ServingCollector, ServingStats
from services.pipeline.interface import NO_OPTIONS, CallOptions
from services.pipeline.local_call import StreamHeaders, call_local_on_loop, open_stream_on_loop
from services.pipeline.local_context import LocalRpcError
from wire.v1 import generation_pb2, inference_pb2

if TYPE_CHECKING:  # imported when a model has `upstream:` (aiohttp is not every process's)
    from services.inference.upstream.service import UpstreamModels


class ModelRouter(InferenceRpcs):
    """Every model this process serves, each request to its own."""

    def __init__(self, config: InferenceConfig, device: DeviceState, *,
                 backend: ModelBackend | None = None, clock: Callable[[], float] = time.monotonic,
                 upstreams: Mapping[str, UpstreamSpec] | None = None, shares: TenantShares | None = None) -> None:
        self.config = config
        self.device = device
        self.builtin: dict[str, InferenceService] = {}  # the built-in models, the first one first
        self.upstreams: UpstreamModels | None = None
        try:
            self.builtin[config.model_id] = InferenceService(config, device, backend=backend, clock=clock,
                                                            shares=shares)
            for model in config.models:
                self.builtin[model.model_id] = InferenceService(model, device, clock=clock, shares=shares)
            if upstreams:
                clash = sorted(set(upstreams) & set(self.builtin))
                if clash:
                    raise ConfigError(f"router.models: {', '.join(clash)} has an `upstream:` and is also an "
                                      "inference model; serve each model one way")
                from services.inference.upstream.service import UpstreamModels

                self.upstreams = UpstreamModels(upstreams)
        except BaseException:
            self.close()
            raise
        self.serving_collector = ServingCollector(self.serving_state, device, GpuGoldenMetrics(device))
        if self.upstreams is not None:
            self.serving_collector.also(self.upstreams.collector)  # on the same /metrics, every layout
        self.metrics_registry = CollectorRegistry()
        self.metrics_registry.register(self.serving_collector)

    @property
    def first(self) -> InferenceService:
        """The model `inference:` configures (the default of a request that names none)."""
        return self.builtin[self.config.model_id]

    def served_ids(self) -> list[str]:
        """Every model id served here: the built-in ones, then those with `upstream:`."""
        return [*self.builtin, *(self.upstreams.endpoints if self.upstreams is not None else ())]

    # -- the model operations: each request to its model's server ------------------------
    def answer(self, request: generation_pb2.GenerateRequest, call: ModelCall) -> Generated:
        return self._server(request.model).answer(request, call)

    def chunks(self, request: generation_pb2.GenerateRequest, call: ModelCall,
               headers: StreamHeaders) -> Generator[generation_pb2.GenerateChunk, None, None]:
        # a generator, so an unknown model is the stream's error; closing it closes the model's
        yield from self._server(request.model).chunks(request, call, headers)

    def describe(self) -> tuple[inference_pb2.ModelInfoResponse, tuple[tuple[str, str], ...]]:
        upstream = [inference_pb2.ModelInfo(id=model_id, device="upstream")
                    for model_id in (self.upstreams.endpoints if self.upstreams is not None else ())]
        listed = [service.model_info() for service in self.builtin.values()]
        return inference_pb2.ModelInfoResponse(models=[*listed, *upstream]), self.first.describe()[1]

    def _server(self, model: str) -> InferenceService | UpstreamModels:
        service = self.builtin.get(model)
        if service is not None:
            return service
        if self.upstreams is not None and model in self.upstreams:
            return self.upstreams
        names = ", ".join(map(repr, self.served_ids()))
        raise LocalRpcError(grpc.StatusCode.NOT_FOUND, f"model {model!r} is not served here; this process serves {names}",
                            self.first.describe()[1])

    # -- on the caller's event loop (`services.inference.api.OnLoop`) --------------------
    def on_loop(self, model: str) -> bool:
        """Whether `model`'s answer can be awaited on the caller's event loop: always — an
        upstream's is network I/O on that loop's connections, a built-in model's outputs are
        handed to that loop once per step, and a model not served here is refused there."""
        return True

    async def generate_on_loop(self, request: generation_pb2.GenerateRequest,
                               options: CallOptions = NO_OPTIONS) -> Generated:
        """`generate`, awaited on the caller's loop: the same answers and refusals."""
        server = self._server(request.model)
        return await call_local_on_loop(lambda call: server.answer_on_loop(request, call), options)

    def generate_stream_on_loop(self, request: generation_pb2.GenerateRequest,
                                options: CallOptions = NO_OPTIONS) -> AsyncChunkStream:
        """`generate_stream`, read on the caller's loop: the same chunks and refusals."""
        server = self._server(request.model)
        return open_stream_on_loop(lambda call, headers: server.chunks_on_loop(request, call, headers), options)

    # -- what the runtime reads of the component -----------------------------------------
    def backlogged(self, models: Collection[str]) -> bool:
        """Each of `models` is a built-in model here with a full batch waiting (a request for
        an idle model, or one not served here, must not wait)."""
        for model in models:
            service = self.builtin.get(model)
            if service is None or not service.backlogged((model,)):
                return False
        return True

    def serving_state(self) -> list[tuple[ModelGauges, ServingStats]]:
        """Every built-in model's gauges and stats: one /metrics, a `model` label each."""
        return [state for service in self.builtin.values() for state in service.serving_state()]

    def health_probe(self) -> None:
        """Every built-in model's tiny forward (an upstream's health is its requests' concern)."""
        for service in self.builtin.values():
            service.health_probe()

    def close(self) -> None:
        """Stop every model, the last built first; construction may have stopped half way."""
        if self.upstreams is not None:
            self.upstreams.close()
        for service in reversed(list(self.builtin.values())):
            service.close()
