"""Test parts for the serving-control tests: a gated/breakable model, a manual clock, polling.

No tests here. The model is the real TinyLM; the wrapper only lets a test decide when each
decode step may run (so "the queue is full" or "the batch holds both" are facts, not
races) and make a step fail as a broken device would.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from monolith.device import DeviceContext
from services.inference.model.backend import TokenizedBackend
from services.inference.model.interface import Segment
from services.inference.model.tiny_lm import TinyLM
from services.inference.model.tokenizer import ByteTokenizer
from services.inference.service import InferenceConfig, InferenceService
from services.pipeline.local_context import LocalContext, LocalRpcError
from wire.v1 import generation_pb2

MODEL = TinyLM.from_seed(1234, max_context=256)


class GatedModel:
    """TinyLM whose steps wait for a permit while held, and fail while `broken`."""

    def __init__(self, inner: TinyLM = MODEL) -> None:
        self.inner = inner
        self.broken = False
        self.steps = 0
        self._held = False
        self._permits = threading.Semaphore(0)

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @property
    def max_context(self) -> int:
        return self.inner.max_context

    def kv_bytes_per_slot(self, max_context: int) -> int:
        return self.inner.kv_bytes_per_slot(max_context)

    def new_cache(self, slots: int, max_context: int, device: Any) -> Any:
        return self.inner.new_cache(slots, max_context, device)

    def release_cache(self, cache: Any, device: Any) -> None:
        self.inner.release_cache(cache, device)

    def step(self, segments: Sequence[Segment], cache: Any) -> Any:
        if self._held and not self._permits.acquire(timeout=20.0):
            raise RuntimeError("test gate never opened")
        if self.broken:
            raise RuntimeError("CUDA error: device lost (injected)")
        self.steps += 1
        return self.inner.step(segments, cache)

    def hold(self) -> None:
        # Drop the permits a previous `open` left over: otherwise the next ~64 steps would
        # run through a "held" gate (a test then raced the neighbours' own decoding).
        while self._permits.acquire(blocking=False):
            pass
        self._held = True

    def release(self, steps: int = 1) -> None:
        for _ in range(steps):
            self._permits.release()

    def open(self) -> None:
        self._held = False
        self.release(64)  # wake any step already waiting


def make_service(model: GatedModel | None = None, clock: Any = time.monotonic, shares: Any = None,
                 **config: Any) -> tuple[InferenceService, GatedModel]:
    model = model or GatedModel()
    backend = TokenizedBackend("tiny-lm", model, ByteTokenizer())  # type: ignore[arg-type]
    service = InferenceService(InferenceConfig.parse(config), DeviceContext(device=_cpu()),
                               backend=backend, clock=clock, shares=shares)
    return service, model


def _cpu() -> Any:
    import torch

    return torch.device("cpu")


def request(prompt: str = "Hello", max_tokens: int = 8, **fields: Any) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(model="tiny-lm", prompt=prompt, max_tokens=max_tokens, **fields)


class Call:
    """A unary Generate in its own thread with an in-process context; `.wait()` for its outcome."""

    def __init__(self, service: InferenceService, req: generation_pb2.GenerateRequest,
                 metadata: Sequence[tuple[str, str]] = ()) -> None:
        self.context = LocalContext(metadata)
        self.response: generation_pb2.GenerateResponse | None = None
        self.error: LocalRpcError | None = None
        self._thread = threading.Thread(target=self._run, args=(service, req), daemon=True)
        self._thread.start()

    def _run(self, service: InferenceService, req: generation_pb2.GenerateRequest) -> None:
        try:
            self.response = service.Generate(req, self.context)
        except LocalRpcError as error:
            self.error = error

    def wait(self, timeout: float = 60.0) -> Call:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "call did not finish"
        return self

    @property
    def tokens(self) -> list[int]:
        assert self.response is not None, f"call failed: {self.error}"
        return list(self.response.token_ids)


def admission_order(service: InferenceService) -> list[str]:
    """Prompts of the jobs admitted into slots, in admission order (the warm-up excluded)."""
    return [bytes(job.request.prompt_ids).decode() for job in service.scheduler.recent_admissions]


def generate(service: InferenceService, req: generation_pb2.GenerateRequest) -> tuple[Any, LocalContext]:
    context = LocalContext()
    return service.Generate(req, context), context
