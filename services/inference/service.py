"""The Inference service: the model behind a servicer, decoding with continuous batching.

One scheduler thread owns the generation engine (`inference_scheduler`). Requests from
any number of gRPC threads (or in-process callers) join the running batch between decode
steps and leave it when they finish, are cancelled, pass their compute budget or read
their stream too slowly — so concurrent requests share each forward pass, in the layered
inference process and in the spine alike.

The serving controls live here, once, for both layouts: priority classes, a compute
budget per request (default: max_tokens × the ms/token measured on the engine's real
steps × a slowdown factor + a margin, capped; see `cost.py`), a KV pool sized from
free memory, a bounded queue that refuses with `retry-after`, load hints on every answer
(`x-spine-load`), a health probe (one tiny forward) and a deterministic mode. Its serving
metrics (`inference_metrics`) are on `metrics_registry`.

A request's `system` prompt is read before its prompt: through the chat template where
the backend has one (the rendered tokens it alone decides being the shared prefix), else
as the system prompt and a blank line (`services.pipeline.system_prompt`); the engine keeps that
prefix's KV once for every request that shares it (`inference.prefix_cache`): as blocks
of a paged pool, or as a copy stored beside a slot pool within what the KV budget leaves
after the pool (`services.inference.model.kv_prefix`).

A caller that goes away stops its generation wherever it waits: a callback on its call
cancels the job (the gRPC server fires it on cancel and deadline, an in-process
`LocalCall` on cancel, its parent's cancel included), and a stream that is closed
early cancels it in its `finally`; the slot is free before the next decode step. The
model answers with values and raises its refusals (`services.inference.rpcs`: the gRPC
servicer and the in-process interface are thin adapters over `answer`/`chunks`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import time
from collections.abc import AsyncGenerator, Collection, Generator, Iterator
from typing import Any, NoReturn

import grpc
from prometheus_client.registry import CollectorRegistry

from services.common import DeviceState
from services.common.tenant_shares import TenantShares, tenant_from
from services.inference.answer_shaping import StreamedAnswer, WholeAnswer
from services.inference.api import Generated
from services.inference.config import InferenceConfig
from services.inference.cost import BudgetRule, StepCost
from services.inference.embeddings import EMBEDDINGS_API, Embedder, EmbeddingRefused, embed_request
from services.inference.genai_metrics import GenAiServerStats
from services.inference.gpu_metrics import GpuGoldenMetrics
from services.inference.jobs import WAKE, Job, JobFailure, QueueFull, ShuttingDown
from services.inference.load_hints import LOAD_HEADER, DeviceGauge, LoadReport
from services.inference.loop_outbox import LoopOutbox
from services.inference.model.backend import ModelBackend, load_backend, make_engine
from services.inference.model.engine import GenerationRequest, StepOutput
from services.inference.model.interface import torch_device
from services.inference.model_start import (
    enter_deterministic,
    leave_deterministic,
    plan_kv,
    probe_forward,
    warm_up_ms_per_token,
)
from services.inference.priority import priority_error
from services.inference.request_body import builtin_refusal
from services.inference.request_encoding import encode_request
from services.inference.rpcs import InferenceRpcs, ModelCall
from services.inference.scheduler import Scheduler
from services.inference.serving_metrics import ModelGauges, ServingCollector, ServingStats
from services.inference.stop_strings import BadStop, stops_of
from services.pipeline.local_call import StreamHeaders
from services.pipeline.local_context import LocalRpcError
from services.pipeline.verdicts import inference_timeout_error
from wire.v1 import generation_pb2, inference_pb2

__all__ = ["InferenceConfig", "InferenceService"]

log = logging.getLogger("spine.inference")

# How long a waiting consumer sleeps between checks of its call when no callback wakes
# it (an in-process deadline): cancels and ends wake it at once through the job's queue.
POLL_S = 1.0


class InferenceService(InferenceRpcs):
    """Serves one model, `spine.v1.Inference`, from the configured backend (the tiny LM by default).

    `backend` replaces the configured one (tests wrap the model to gate or break its steps);
    `clock` drives compute budgets and aging.
    """

    def __init__(self, config: InferenceConfig, device: DeviceState, *,
                 backend: ModelBackend | None = None, clock: Any = time.monotonic,
                 shares: TenantShares | None = None) -> None:
        self.config = config
        self.device = device
        self.shares = shares or TenantShares()  # each tenant's weight in the queue (the gateway names it)
        self._deterministic_before = enter_deterministic(config.seed) if config.deterministic else None
        spec = {"model_id": config.model_id, "seed": config.seed, **config.backend.spec()}
        self.backend = backend if backend is not None else load_backend(spec, device=device)
        self.kv_plan = plan_kv(config, self.backend, device)
        self.engine = make_engine(self.backend, device, self.kv_plan.slots, prefix_caching=config.prefix_cache,
                                  prefix_budget_bytes=self.kv_plan.spare_bytes)
        self.stats = ServingStats(GenAiServerStats(config.model_id))
        self.cost = StepCost(self.engine.max_slots, warm_up_ms_per_token(self.backend, self.engine,
                                                                          config.warmup_tokens))
        self.budget = BudgetRule(config.timeout_slowdown, config.timeout_margin_ms, config.max_timeout_ms)
        self.scheduler = Scheduler(self.engine, config.max_queue, cost=self.cost, budget=self.budget,
                                   aging_ms=config.aging_ms, stream_idle_s=config.stream_idle_timeout_s,
                                   stream_max_bytes=config.stream_buffer_max_bytes, clock=clock,
                                   streams=getattr(device, "stream", None), observer=self.stats,
                                   headroom_slots=config.share_headroom_slots)
        self.serving_collector = ServingCollector(self.serving_state, device, GpuGoldenMetrics(device))
        self.metrics_registry = CollectorRegistry()
        self.metrics_registry.register(self.serving_collector)
        self._gauge = DeviceGauge(device)
        log.info("%s", self.kv_plan.describe())
        if self.engine.prefixes is not None:
            log.info("shared prefixes: stored once and copied into each slot, at most %.1f MiB (what the KV "
                     "budget leaves after the pool)", self.engine.prefixes.budget_bytes / (1 << 20))
        log.info("inference %s on %s: %.3f ms per token at the warm-up, then measured on every step; "
                 "default compute budget = max_tokens × measured ms/token × %.1f + %.0f ms, at most %d ms",
                 config.model_id, torch_device(device), self.ms_per_token, config.timeout_slowdown,
                 config.timeout_margin_ms, config.max_timeout_ms)

    # -- the model's operations (`InferenceRpcs` serves them in process and over gRPC) ---
    def answer(self, request: generation_pb2.GenerateRequest, call: ModelCall) -> Generated:
        if request.api == EMBEDDINGS_API:
            return self._embed(request)
        with self.stats.genai.serving(request) as served:  # the GenAI server metrics
            stops = self._stops(request)
            job, prompt_tokens = self._start(request, call, stream=False)
            served.job = job
            whole = WholeAnswer()
            for output in self._outputs(job, call):
                whole.take(output)
        trailing = self._load_metadata()
        return Generated(whole.response(self.backend, request, stops, prompt_tokens), trailing)

    def chunks(self, request: generation_pb2.GenerateRequest, call: ModelCall,
               headers: StreamHeaders) -> Generator[generation_pb2.GenerateChunk, None, None]:
        with self.stats.genai.serving(request) as served:  # the GenAI server metrics
            stops = self._stops(request)
            job, _ = self._start(request, call, stream=True)
            served.job = job
            streamed = StreamedAnswer(self.backend, request, stops)
            try:
                for output in self._outputs(job, call):
                    chunk = streamed.chunk(output)
                    if streamed.ended:
                        headers.set_trailing(self._load_metadata())
                    yield chunk
                    if streamed.ended:
                        return
            finally:  # closed early (the reader went away) or failed: the slot is freed before the next step
                self.scheduler.cancel(job)

    # -- the same, awaited on the caller's event loop (`services.inference.api.OnLoop`) ----
    async def answer_on_loop(self, request: generation_pb2.GenerateRequest, call: ModelCall) -> Generated:
        """`answer` for a caller on an event loop: the job's outputs handed to that loop with
        the step's others (`services.inference.loop_outbox`), no thread waiting on them. An
        embedding (a forward on the caller's thread) runs on the loop's default executor."""
        if request.api == EMBEDDINGS_API:
            return await asyncio.get_running_loop().run_in_executor(None, self._embed, request)
        with self.stats.genai.serving(request) as served:
            stops = self._stops(request)
            job, prompt_tokens = self._start(request, call, stream=False, on_loop=True)
            served.job = job
            whole = WholeAnswer()
            for output in await self._next_outputs(job, call):  # a unary job's outputs come at once
                whole.take(output)
        trailing = self._load_metadata()
        return Generated(whole.response(self.backend, request, stops, prompt_tokens), trailing)

    async def chunks_on_loop(self, request: generation_pb2.GenerateRequest, call: ModelCall,
                             headers: StreamHeaders) -> AsyncGenerator[generation_pb2.GenerateChunk, None]:
        """`chunks` for a caller on an event loop, each step's output awaited there."""
        with self.stats.genai.serving(request) as served:
            stops = self._stops(request)
            job, _ = self._start(request, call, stream=True, on_loop=True)
            served.job = job
            streamed = StreamedAnswer(self.backend, request, stops)
            try:
                while not streamed.ended:
                    (output,) = await self._next_outputs(job, call)
                    chunk = streamed.chunk(output)
                    if streamed.ended:
                        headers.set_trailing(self._load_metadata())
                    yield chunk
            finally:
                self.scheduler.cancel(job)

    def _embed(self, request: generation_pb2.GenerateRequest) -> Generated:
        """`POST /v1/embeddings` from the built-in model's pooled hidden states, where its backend
        pools (`Embedder`); else the client's 400 naming the model. One forward per input on the
        request's thread, beside the engine's steps (the forward shares no cache with them)."""
        self._check_served(request)
        if not isinstance(self.backend, Embedder):
            self._refuse(grpc.StatusCode.INVALID_ARGUMENT,
                         f"embeddings: the built-in model {request.model!r} does not embed (a transformers model "
                         "directory does: inference.backend.class hf); or route the request to a model with "
                         "upstream: (an engine serving /v1/embeddings)")
        try:
            embedded = embed_request(request.body, request.model, self.backend)
        except EmbeddingRefused as error:
            self._refuse(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        return Generated(generation_pb2.GenerateResponse(model=request.model, body=embedded.body, finish_reason="stop",
                                                         prompt_tokens=embedded.prompt_tokens),
                         self._load_metadata())

    def _check_served(self, request: generation_pb2.GenerateRequest) -> None:
        """NOT_FOUND unless the request names the model this process serves."""
        if request.model != self.config.model_id:
            self._refuse(grpc.StatusCode.NOT_FOUND,
                         f"model {request.model!r} is not served here; this process serves {self.config.model_id!r}")

    def _stops(self, request: generation_pb2.GenerateRequest) -> tuple[str, ...]:
        try:
            return stops_of(request.api, request.body)
        except BadStop as error:
            self._refuse(grpc.StatusCode.INVALID_ARGUMENT, str(error))

    def describe(self) -> tuple[inference_pb2.ModelInfoResponse, tuple[tuple[str, str], ...]]:
        return inference_pb2.ModelInfoResponse(models=[self.model_info()]), self._load_metadata()

    def model_info(self) -> inference_pb2.ModelInfo:
        """This model as `Models` lists it: its id, context, device and load now."""
        return inference_pb2.ModelInfo(id=self.config.model_id, max_context=self.backend.max_context,
                                       device=str(torch_device(self.device)), load=self.load_report().header())

    # -- serving controls ------------------------------------------------------------
    @property
    def ms_per_token(self) -> float:
        """What a token costs now, at the running batch's size (measured, see `cost.StepCost`)."""
        return self.cost.ms_per_token(max(1, self.engine.active_count))

    def default_timeout_ms(self, max_tokens: int, batch: int | None = None) -> int:
        """max_tokens × measured ms/token (at `batch`, default the running batch) × slowdown
        + margin, at most `max_timeout_ms`. A running job's default budget is re-derived
        from the cost on every step and only ever grows (`Scheduler._expire`)."""
        ms = self.ms_per_token if batch is None else self.cost.ms_per_token(batch)
        return self.budget.default_ms(max_tokens, ms)

    def load_report(self) -> LoadReport:
        mem_free_mb, util = self._gauge.read()
        free = self.engine.free_slots
        return LoadReport(queue=self.scheduler.queue_depth, running=self.engine.active_count,
                          slots=self.engine.max_slots, kv_free=free, mem_free_mb=mem_free_mb,
                          ms_per_token=self.ms_per_token, util=util, busy=self.cost.busy.fraction())

    def backlogged(self, models: Collection[str]) -> bool:
        """Whether every one of `models` is served here with a full batch of requests already
        waiting for its KV slots: work admitted a few ms later still finds it busy, so the
        spine's admission may wait to decide more requests at once (`monolith.batcher`)."""
        return (all(model == self.config.model_id for model in models)
                and self.scheduler.queue_depth >= self.engine.max_slots)

    def serving_state(self) -> list[tuple[ModelGauges, ServingStats]]:
        """What /metrics reads of this model at a scrape (`inference_metrics`)."""
        engine, kv, stored = self.engine, self.engine.kv, self.engine.prefixes
        lookups = kv.prefixes if kv is not None else stored
        gauges = ModelGauges(
            model=self.config.model_id, slots_used=engine.active_count, slots_free=engine.free_slots,
            queue=self.scheduler.queue_by_class(), blocks=kv.usage() if kv is not None else None,
            prefix_hits=lookups.hits if lookups is not None else 0,
            prefix_misses=lookups.misses if lookups is not None else 0,
            prefix_bytes=stored.bytes if stored is not None else None)
        return [(gauges, self.stats)]

    def health_probe(self) -> None:
        """One tiny forward on the model's device (`model_start.probe_forward`); raises when
        the model cannot run."""
        probe_forward(self.backend, torch_device(self.device))

    # -- plumbing ------------------------------------------------------------------
    def _start(self, request: generation_pb2.GenerateRequest, call: ModelCall, *, stream: bool,
               on_loop: bool = False) -> tuple[Job, int]:
        # No load hint set here: every refusal goes through `_refuse`, which carries it, and an
        # answer carries it at its end (one load report per request, not two).
        self._check_served(request)
        refused = builtin_refusal(request.api, request.body, request.model)
        if refused is not None:
            self._refuse(grpc.StatusCode.INVALID_ARGUMENT, refused)
        if request.max_tokens <= 0:
            self._refuse(grpc.StatusCode.INVALID_ARGUMENT, f"max_tokens: must be > 0, got {request.max_tokens}")
        if not request.prompt:
            self._refuse(grpc.StatusCode.INVALID_ARGUMENT, "prompt: must not be empty")
        problem = priority_error(request.priority)
        if problem is not None:
            self._refuse(grpc.StatusCode.INVALID_ARGUMENT, problem)
        problem = inference_timeout_error(request.inference_timeout_ms, self.config.max_timeout_ms)
        if problem is not None:
            self._refuse(grpc.StatusCode.INVALID_ARGUMENT, problem)
        try:
            prefix_ids, prompt_ids = encode_request(self.backend, request)
        except ValueError as error:  # messages a chat template cannot render
            self._refuse(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        total = len(prefix_ids) + len(prompt_ids) + 1 + request.max_tokens  # + BOS
        if total > self.engine.max_context:
            system = f"system ({len(prefix_ids)} tokens) + " if prefix_ids else ""
            self._refuse(grpc.StatusCode.INVALID_ARGUMENT,
                        f"{system}prompt ({len(prompt_ids)} tokens) + BOS + max_tokens ({request.max_tokens}) = "
                        f"{total} exceeds the model's context of {self.engine.max_context}")
        tenant = tenant_from(call.invocation_metadata())
        seed = request.seed if request.HasField("seed") else None
        if seed is None and self.config.deterministic and request.temperature > 0:
            seed = self.config.seed  # deterministic mode: a sampled answer is reproducible too
        job = Job(GenerationRequest(prompt_ids=prompt_ids, max_tokens=request.max_tokens,
                                    temperature=float(request.temperature), seed=seed, prefix_ids=prefix_ids),
                  priority=request.priority, budget_ms=float(request.inference_timeout_ms),
                  default_budget=request.inference_timeout_ms == 0, stream=stream,
                  tenant=tenant, weight=self.shares.weight(tenant),
                  out=LoopOutbox(asyncio.get_running_loop()) if on_loop else queue.Queue())
        try:
            self.scheduler.submit(job)
        except QueueFull as error:
            self._refuse(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error),
                        (("retry-after", f"{error.retry_after_s:.3f}"),))
        except ShuttingDown as error:
            self._refuse(grpc.StatusCode.UNAVAILABLE, str(error))
        if not call.add_callback(lambda: self._caller_left(job)):
            self.scheduler.cancel(job)  # the call had already ended
        return job, len(prefix_ids) + len(prompt_ids)

    def _caller_left(self, job: Job) -> None:
        """The caller left: its job stops before the next step and its consumer answers at once,
        even mid-step. A call ending after its job (every answered one) has nothing to stop."""
        if job.done or job.failure is not None:
            return
        self.scheduler.cancel(job)
        job.out.put_nowait(WAKE)

    def _outputs(self, job: Job, call: ModelCall) -> Iterator[StepOutput]:
        """Yield the job's step outputs until it finishes; stop it when the caller goes away.

        The wait is woken by the job's queue — a token, the end, or the failure a cancel
        callback causes — so a consumer costs nothing while it waits, however many wait."""
        while True:
            item = self.scheduler.next_output(job, self._wait_s(job, call))
            if item is None or item is WAKE:
                self._check_failed(job)
                continue
            if isinstance(item, list):  # a unary job's whole answer, handed over once
                yield from item
                return
            yield item
            if item.finished:
                return

    async def _next_outputs(self, job: Job, call: ModelCall) -> list[StepOutput]:
        """`_outputs` awaited on the caller's loop, woken with the step's other outputs: the
        job's next output (a unary job's: all of them). Not an async generator: one left
        unfinished is closed by the loop's finalizer, a task and a wake-up of its own."""
        while True:
            item = await self.scheduler.next_output_on_loop(job, self._wait_s(job, call))
            if item is None or item is WAKE:
                self._check_failed(job)
                continue
            return item if isinstance(item, list) else [item]

    def _wait_s(self, job: Job, call: ModelCall) -> float:
        """How long to wait for the job's next output: until the caller's deadline, at most
        `POLL_S`; the caller's refusal if it has gone (its job stopped first)."""
        if not call.is_active():
            self.scheduler.cancel(job)  # frees the batch slot and KV cache before the next step
            remaining = call.time_remaining()
            if remaining is not None and remaining <= 0:
                self._refuse(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded during generation")
            self._refuse(grpc.StatusCode.CANCELLED, "generation cancelled by the caller")
        remaining = call.time_remaining()
        return POLL_S if remaining is None else min(POLL_S, max(0.001, remaining))

    def _check_failed(self, job: Job) -> None:
        """A woken or timed-out wait: the job's failure, once what came before it was read."""
        if job.failure is not None and job.out.empty():
            self._refuse_for(job.failure)

    def _refuse_for(self, failure: BaseException) -> NoReturn:
        if isinstance(failure, JobFailure):
            retry = getattr(failure, "retry_after_s", None)  # a full queue's place given to another tenant
            self._refuse(failure.code, str(failure), (("retry-after", f"{retry:.3f}"),) if retry is not None else ())
        if isinstance(failure, ValueError):
            self._refuse(grpc.StatusCode.INVALID_ARGUMENT, str(failure))
        self._refuse(grpc.StatusCode.INTERNAL, f"model failed: {failure}")

    def _refuse(self, code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str], ...] = ()) -> NoReturn:
        """End the request with `code`: the caller's error, the model's load hint with it."""
        raise LocalRpcError(code, details, self._load_metadata() + trailing)

    def _load_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((LOAD_HEADER, self.load_report().header()),)

    def close(self) -> None:
        self.scheduler.close()
        if self._deterministic_before is not None:
            leave_deterministic(self._deterministic_before)
            self._deterministic_before = None

