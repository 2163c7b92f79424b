"""The Inference service: the model behind a servicer, decoding with continuous batching.

One scheduler thread owns the generation engine. Requests from any number of gRPC
threads (or in-process callers) join the running batch between decode steps and leave
it when they finish, are cancelled, or pass their compute budget — so concurrent
requests share each forward pass, in the layered inference process and in the spine
alike.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from services.common import ConfigError, DeviceState, number
from services.model.backend import load_backend, make_engine
from services.model.engine import GenerationEngine, GenerationRequest, SlotsExhausted
from spine.v1 import generation_pb2, inference_pb2, inference_pb2_grpc

log = logging.getLogger("spine.inference")

_CANCELLED = object()


@dataclass(frozen=True)
class InferenceConfig:
    model_id: str = "tiny-lm"
    seed: int = 1234
    max_batch: int = 16
    max_queue: int = 256
    backend: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> InferenceConfig:
        known = {"model_id", "seed", "max_batch", "max_queue", "backend"}
        unknown = sorted(set(cfg) - known)
        if unknown:
            raise ConfigError(f"inference: unknown key(s) {unknown}; known: {sorted(known)}")
        model_id = cfg.get("model_id", cls.model_id)
        if not isinstance(model_id, str) or not model_id:
            raise ConfigError(f"inference.model_id: expected a non-empty string, got {model_id!r}")
        seed = cfg.get("seed", cls.seed)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"inference.seed: expected an integer, got {seed!r}")
        backend = cfg.get("backend") or {}
        if not isinstance(backend, Mapping):
            raise ConfigError("inference.backend: expected a mapping")
        return cls(
            model_id=model_id, seed=seed,
            max_batch=int(number(cfg, "max_batch", cls.max_batch, where="inference", minimum=1)),
            max_queue=int(number(cfg, "max_queue", cls.max_queue, where="inference", minimum=1)),
            backend=backend,
        )


@dataclass
class _Job:
    """One request's place in the scheduler: its tokens arrive on `out`."""

    request: GenerationRequest
    out: queue.Queue[Any] = field(default_factory=queue.Queue)
    handle: Any = None
    cancelled: bool = False


class Scheduler:
    """Owns the engine; admits waiting jobs between steps; delivers tokens per job."""

    def __init__(self, engine: GenerationEngine, max_queue: int) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self._waiting: deque[_Job] = deque()
        self._running: dict[Any, _Job] = {}
        self._cancels: deque[_Job] = deque()
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="inference-scheduler", daemon=True)
        self._thread.start()

    def submit(self, job: _Job) -> None:
        with self._wake:
            if self._closed:
                raise RuntimeError("inference is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise OverflowError(f"inference queue is full ({self.max_queue} waiting)")
            self._waiting.append(job)
            self._wake.notify()

    def cancel(self, job: _Job) -> None:
        with self._wake:
            if not job.cancelled:
                job.cancelled = True
                self._cancels.append(job)
                self._wake.notify()

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._closed and not self._waiting and not self._running and not self._cancels:
                    self._wake.wait()
                if self._closed and not self._running and not self._waiting:
                    return
                cancels = list(self._cancels)
                self._cancels.clear()
            for job in cancels:
                self._drop(job)
            self._admit()
            if not self._running:
                continue
            try:
                outputs = self.engine.step()
            except Exception as error:  # the model failed: fail the running jobs, keep serving
                log.exception("decode step failed")
                for job in list(self._running.values()):
                    job.out.put(error)
                    self._drop(job)
                continue
            for output in outputs:
                owner = self._running.get(output.handle)
                if owner is None:
                    continue
                owner.out.put(output)
                if output.finished:
                    del self._running[output.handle]

    def _admit(self) -> None:
        with self._wake:
            while self._waiting:
                job = self._waiting[0]
                if job.cancelled:
                    self._waiting.popleft()
                    continue
                try:
                    job.handle = self.engine.submit(job.request)
                except SlotsExhausted:
                    return
                except ValueError as error:
                    self._waiting.popleft()
                    job.out.put(error)
                    continue
                self._waiting.popleft()
                self._running[job.handle] = job

    def _drop(self, job: _Job) -> None:
        if job.handle is not None and self._running.pop(job.handle, None) is not None:
            self.engine.cancel(job.handle)
        job.out.put(_CANCELLED)

    def close(self) -> None:
        with self._wake:
            self._closed = True
            for job in self._waiting:
                job.out.put(RuntimeError("inference is shutting down"))
            self._waiting.clear()
            self._wake.notify()
        self._thread.join(timeout=5.0)


class InferenceService(inference_pb2_grpc.InferenceServicer):
    """Serves `spine.v1.Inference` from the configured backend (the tiny LM by default)."""

    def __init__(self, config: InferenceConfig, device: DeviceState) -> None:
        self.config = config
        spec = {"model_id": config.model_id, "seed": config.seed, **dict(config.backend)}
        self.backend = load_backend(spec, device=device)
        self.device = device
        self.engine = make_engine(self.backend, device, config.max_batch)
        self.scheduler = Scheduler(self.engine, config.max_queue)

    # -- gRPC --------------------------------------------------------------------
    def Generate(self, request: generation_pb2.GenerateRequest, context: Any) -> generation_pb2.GenerateResponse:
        job, prompt_ids = self._start(request, context)
        tokens: list[int] = []
        finish = ""
        for output in self._outputs(job, context):
            if output.finish_reason != "stop":  # a stop's token is EOS, not part of the answer
                tokens.append(output.token_id)
            finish = output.finish_reason or finish
        return generation_pb2.GenerateResponse(
            text=self.backend.decode(tokens), token_ids=tokens, model=request.model, finish_reason=finish,
            prompt_tokens=len(prompt_ids), completion_tokens=len(tokens))

    def GenerateStream(self, request: generation_pb2.GenerateRequest,
                       context: Any) -> Iterator[generation_pb2.GenerateChunk]:
        job, _ = self._start(request, context)
        tokens: list[int] = []
        sent = ""
        for index, output in enumerate(self._outputs(job, context)):
            new = [] if output.finish_reason == "stop" else [output.token_id]
            tokens.extend(new)
            text = self.backend.decode(tokens)
            piece, sent = text[len(sent):], text
            yield generation_pb2.GenerateChunk(text=piece, token_ids=new, index=index,
                                               finish_reason=output.finish_reason or "", model=request.model)

    def Models(self, request: inference_pb2.ModelInfoRequest, context: Any) -> inference_pb2.ModelInfoResponse:
        return inference_pb2.ModelInfoResponse(models=[inference_pb2.ModelInfo(
            id=self.config.model_id, max_context=self.backend.max_context, device=str(self.device.device))])

    # -- plumbing ------------------------------------------------------------------
    def _start(self, request: generation_pb2.GenerateRequest, context: Any) -> tuple[_Job, list[int]]:
        if request.model != self.config.model_id:
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"model {request.model!r} is not served here; this process serves {self.config.model_id!r}")
        if request.max_tokens <= 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"max_tokens: must be > 0, got {request.max_tokens}")
        if not request.prompt:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt: must not be empty")
        prompt_ids = self.backend.encode(request.prompt)
        total = len(prompt_ids) + 1 + request.max_tokens  # + BOS
        if total > self.engine.max_context:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"prompt ({len(prompt_ids)} tokens) + BOS + max_tokens ({request.max_tokens}) = {total} "
                          f"exceeds the model's context of {self.engine.max_context}")
        seed = request.seed if request.HasField("seed") else None
        job = _Job(GenerationRequest(prompt_ids=prompt_ids, max_tokens=request.max_tokens,
                                     temperature=float(request.temperature), seed=seed))
        try:
            self.scheduler.submit(job)
        except OverflowError as error:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
        except RuntimeError as error:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        context.add_callback(lambda: self.scheduler.cancel(job))
        return job, prompt_ids

    def _outputs(self, job: _Job, context: Any) -> Iterator[Any]:
        """Yield the job's step outputs until it finishes; stop it when the caller goes away."""
        while True:
            if not context.is_active():
                self.scheduler.cancel(job)  # frees the batch slot and KV cache at the next step
                remaining = context.time_remaining()
                if remaining is not None and remaining <= 0:
                    context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded during generation")
                context.abort(grpc.StatusCode.CANCELLED, "generation cancelled by the caller")
            try:
                item = job.out.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is _CANCELLED:
                context.abort(grpc.StatusCode.CANCELLED, "generation cancelled")
            if isinstance(item, ValueError):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(item))
            if isinstance(item, Exception):
                context.abort(grpc.StatusCode.INTERNAL, f"model failed: {item}")
            yield item
            if item.finished:
                return

    def close(self) -> None:
        self.scheduler.close()
