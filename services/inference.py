"""The Inference service: the model behind a servicer, decoding with continuous batching.

One scheduler thread owns the generation engine (`inference_scheduler`). Requests from
any number of gRPC threads (or in-process callers) join the running batch between decode
steps and leave it when they finish, are cancelled, pass their compute budget or read
their stream too slowly — so concurrent requests share each forward pass, in the layered
inference process and in the spine alike.

The serving controls live here, once, for both layouts: priority classes, a compute
budget per request (default: max_tokens × the ms/token measured at start × a slowdown
factor + a margin, capped), a KV pool sized from free memory, load hints on every answer
(`x-spine-load`), a health probe (one tiny forward) and a deterministic mode.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import random
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NoReturn

import grpc
import torch

from services.common import ConfigError, DeviceState, section
from services.inference_config import InferenceConfig
from services.inference_load import LOAD_HEADER, DeviceGauge, LoadReport
from services.inference_scheduler import WAKE, Job, JobFailure, QueueFull, Scheduler, ShuttingDown
from services.model.backend import ModelBackend, load_backend, make_engine
from services.model.engine import GenerationRequest, StepOutput
from services.model.interface import Segment, torch_device
from services.model.kv_budget import KVPlan, free_device_bytes, kv_bytes_per_slot, plan_kv_slots, weight_bytes
from services.pipeline.stage import Phase, Stage
from services.priority import priority_error
from spine.v1 import generation_pb2, inference_pb2, inference_pb2_grpc

__all__ = ["InferenceConfig", "InferenceService", "InferenceStage"]

log = logging.getLogger("spine.inference")


class InferenceService(inference_pb2_grpc.InferenceServicer):
    """Serves `spine.v1.Inference` from the configured backend (the tiny LM by default).

    `backend` replaces the configured one (tests wrap the model to gate or break its steps);
    `clock` drives compute budgets and aging.
    """

    def __init__(self, config: InferenceConfig, device: DeviceState, *,
                 backend: ModelBackend | None = None, clock: Any = time.monotonic) -> None:
        self.config = config
        self.device = device
        self._deterministic_before: bool | None = None
        if config.deterministic:
            self._enter_deterministic()
        spec = {"model_id": config.model_id, "seed": config.seed, **config.backend.spec()}
        self.backend = backend if backend is not None else load_backend(spec, device=device)
        self.kv_plan = self._plan_kv()
        self.engine = make_engine(self.backend, device, self.kv_plan.slots)
        self.ms_per_token = self._measure_ms_per_token()
        self.scheduler = Scheduler(self.engine, config.max_queue, aging_ms=config.aging_ms, clock=clock,
                                   streams=getattr(device, "stream", None))
        self._gauge = DeviceGauge(device)
        log.info("%s", self.kv_plan.describe())
        log.info("inference %s on %s: %.3f ms per token measured at start; default compute budget "
                 "= max_tokens × %.3f ms × %.1f + %.0f ms, at most %d ms", config.model_id,
                 torch_device(device), self.ms_per_token, self.ms_per_token, config.timeout_slowdown,
                 config.timeout_margin_ms, config.max_timeout_ms)

    # -- gRPC --------------------------------------------------------------------
    def Generate(self, request: generation_pb2.GenerateRequest, context: Any) -> generation_pb2.GenerateResponse:
        job, prompt_ids = self._start(request, context, buffer=0)
        tokens: list[int] = []
        finish = ""
        for output in self._outputs(job, context):
            if output.finish_reason != "stop":  # a stop's token is EOS, not part of the answer
                tokens.append(output.token_id)
            finish = output.finish_reason or finish
        context.set_trailing_metadata(self._load_metadata())
        return generation_pb2.GenerateResponse(
            text=self.backend.decode(tokens), token_ids=tokens, model=request.model, finish_reason=finish,
            prompt_tokens=len(prompt_ids), completion_tokens=len(tokens))

    def GenerateStream(self, request: generation_pb2.GenerateRequest,
                       context: Any) -> Iterator[generation_pb2.GenerateChunk]:
        job, _ = self._start(request, context, buffer=self.config.stream_buffer_chunks)
        tokens: list[int] = []
        sent = ""
        for index, output in enumerate(self._outputs(job, context)):
            new = [] if output.finish_reason == "stop" else [output.token_id]
            tokens.extend(new)
            text = self.backend.decode(tokens)
            piece, sent = text[len(sent):], text
            if output.finished:
                context.set_trailing_metadata(self._load_metadata())
            yield generation_pb2.GenerateChunk(text=piece, token_ids=new, index=index,
                                               finish_reason=output.finish_reason or "", model=request.model)

    def Models(self, request: inference_pb2.ModelInfoRequest, context: Any) -> inference_pb2.ModelInfoResponse:
        context.set_trailing_metadata(self._load_metadata())
        return inference_pb2.ModelInfoResponse(models=[inference_pb2.ModelInfo(
            id=self.config.model_id, max_context=self.backend.max_context, device=str(torch_device(self.device)))])

    # -- serving controls ------------------------------------------------------------
    def default_timeout_ms(self, max_tokens: int) -> int:
        """max_tokens × measured ms/token × slowdown + margin, at most `max_timeout_ms`."""
        cfg = self.config
        budget = math.ceil(max_tokens * self.ms_per_token * cfg.timeout_slowdown + cfg.timeout_margin_ms)
        return min(cfg.max_timeout_ms, budget)

    def load_report(self) -> LoadReport:
        mem_free_mb, util = self._gauge.read()
        free = self.engine.free_slots
        return LoadReport(queue=self.scheduler.queue_depth, running=self.engine.active_count,
                          slots=self.engine.max_slots, kv_free=free, mem_free_mb=mem_free_mb,
                          ms_per_token=self.ms_per_token, util=util)

    def health_probe(self) -> None:
        """One tiny forward (BOS alone) on the model's device; raises when the model cannot run.

        It uses a one-slot cache of its own, so it never touches a running sequence's slot
        and needs no engine lock; the `.to("cpu")` waits for the device to finish.
        """
        model = self.backend.model
        device = torch_device(self.device)
        cache = model.new_cache(1, 2, device)
        try:
            logits = model.step([Segment(0, 0, (self.backend.tokenizer.bos_id,))], cache).to("cpu")
        finally:
            model.release_cache(cache, device)
        if logits.shape[0] != 1 or not bool(torch.isfinite(logits).any()):
            raise RuntimeError(f"health forward gave unusable logits (shape {tuple(logits.shape)})")

    # -- plumbing ------------------------------------------------------------------
    def _start(self, request: generation_pb2.GenerateRequest, context: Any, *, buffer: int) -> tuple[Job, list[int]]:
        context.set_trailing_metadata(self._load_metadata())
        if request.model != self.config.model_id:
            self._abort(context, grpc.StatusCode.NOT_FOUND,
                        f"model {request.model!r} is not served here; this process serves {self.config.model_id!r}")
        if request.max_tokens <= 0:
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"max_tokens: must be > 0, got {request.max_tokens}")
        if not request.prompt:
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "prompt: must not be empty")
        problem = priority_error(request.priority)
        if problem is not None:
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, problem)
        budget_ms = self._budget_ms(request, context)
        prompt_ids = self.backend.encode(request.prompt)
        total = len(prompt_ids) + 1 + request.max_tokens  # + BOS
        if total > self.engine.max_context:
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                        f"prompt ({len(prompt_ids)} tokens) + BOS + max_tokens ({request.max_tokens}) = {total} "
                        f"exceeds the model's context of {self.engine.max_context}")
        seed = request.seed if request.HasField("seed") else None
        if seed is None and self.config.deterministic and request.temperature > 0:
            seed = self.config.seed  # deterministic mode: a sampled answer is reproducible too
        job = Job(GenerationRequest(prompt_ids=prompt_ids, max_tokens=request.max_tokens,
                                    temperature=float(request.temperature), seed=seed),
                  priority=request.priority, budget_ms=budget_ms, buffer=buffer)
        try:
            self.scheduler.submit(job)
        except QueueFull as error:
            self._abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
        except ShuttingDown as error:
            self._abort(context, grpc.StatusCode.UNAVAILABLE, str(error))
        context.add_callback(lambda: self.scheduler.cancel(job))
        return job, prompt_ids

    def _budget_ms(self, request: generation_pb2.GenerateRequest, context: Any) -> float:
        asked, cap = request.inference_timeout_ms, self.config.max_timeout_ms
        if asked < 0:
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                        f"inference_timeout_ms: must be >= 0 (0 = the server default), got {asked}")
        if asked > cap:
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                        f"inference_timeout_ms: {asked} is above the cap of {cap} ms (inference.max_timeout_ms)")
        return float(asked or self.default_timeout_ms(request.max_tokens))

    def _outputs(self, job: Job, context: Any) -> Iterator[StepOutput]:
        """Yield the job's step outputs until it finishes; stop it when the caller goes away."""
        while True:
            if not context.is_active():
                self.scheduler.cancel(job)  # frees the batch slot and KV cache before the next step
                remaining = context.time_remaining()
                if remaining is not None and remaining <= 0:
                    self._abort(context, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded during generation")
                self._abort(context, grpc.StatusCode.CANCELLED, "generation cancelled by the caller")
            if job.failure is not None:
                try:  # what was delivered before the failure still reaches the caller
                    item = job.out.get_nowait()
                except queue.Empty:
                    self._abort_for(job.failure, context)
            else:
                try:
                    item = job.out.get(timeout=0.05)
                except queue.Empty:
                    continue
            if item is WAKE:
                continue
            if isinstance(item, list):  # a unary job's whole answer, handed over once
                yield from item
                return
            yield item
            if item.finished:
                return

    def _abort_for(self, failure: BaseException, context: Any) -> NoReturn:
        if isinstance(failure, JobFailure):
            self._abort(context, failure.code, str(failure))
        if isinstance(failure, ValueError):
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(failure))
        self._abort(context, grpc.StatusCode.INTERNAL, f"model failed: {failure}")

    def _abort(self, context: Any, code: grpc.StatusCode, details: str) -> NoReturn:
        context.set_trailing_metadata(self._load_metadata())
        context.abort(code, details)
        raise AssertionError("context.abort returned")  # abort always raises

    def _load_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((LOAD_HEADER, self.load_report().header()),)

    def _plan_kv(self) -> KVPlan:
        cfg = self.config
        model = self.backend.model
        try:
            return plan_kv_slots(
                per_slot_bytes=kv_bytes_per_slot(model, self.backend.max_context),
                weight_bytes=weight_bytes(model),
                free_bytes=free_device_bytes(self.device, int(cfg.kv_cpu_memory_cap_mb * (1 << 20))),
                memory_fraction=cfg.kv_memory_fraction, max_batch=cfg.max_batch,
                requested=cfg.kv_slots)
        except ValueError as error:
            raise ConfigError(f"inference.kv_cache_max_entries: {error}") from error

    def _measure_ms_per_token(self) -> float:
        """Decode cost from a tiny warm-up: one run to warm the kernels, one measured."""
        prompt = self.backend.encode("warm up")[: max(1, self.engine.max_context // 4)]
        tokens = max(1, min(self.config.warmup_tokens, self.engine.max_context - len(prompt) - 1))
        request = GenerationRequest(prompt_ids=prompt, max_tokens=tokens)
        self.engine.generate([request])
        started = time.perf_counter()
        result = self.engine.generate([request])[0]
        elapsed_ms = (time.perf_counter() - started) * 1000.0
        steps = len(result.token_ids) + (1 if result.finish_reason == "stop" else 0)
        return elapsed_ms / max(1, steps)

    def _enter_deterministic(self) -> None:
        """Deterministic kernels and fixed seeds for this process (undone by `close`)."""
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it for determinism
        self._deterministic_before = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
        torch.manual_seed(self.config.seed)
        random.seed(self.config.seed)

    def close(self) -> None:
        self.scheduler.close()
        if self._deterministic_before is not None:
            torch.use_deterministic_algorithms(self._deterministic_before)
            self._deterministic_before = None


class InferenceStage(Stage):
    """The model's place in the path: fail closed, its budget the compute budget. The gateway
    calls it per request (unary or streaming); the engine batches decode steps itself."""

    method = "Generate"
    phase = Phase.MODEL
    order = 50


def build(config: Mapping[str, Any], device: DeviceState, run_dir: Path) -> Any:
    """The servicer from its section of a whole config (the component table's factory)."""
    return InferenceService(InferenceConfig.from_dict(section(config, "inference")), device)
