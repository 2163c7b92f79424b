"""The inference scheduler: one thread owns the engine; jobs join and leave between decode steps.

Between two steps the scheduler, in this order: stops cancelled jobs, stops jobs past
their compute budget, and admits waiting jobs into free KV slots — highest priority class
first, with aging so the lowest class never starves (see `services.priority`). Then it
runs one batched step and hands each job its token.

It never blocks on a consumer: a job's output queue is bounded (for streams), and a job
whose consumer has let it fill is stopped — slot and KV cache freed at once — and told
why; the other jobs in the batch go on at full speed. Every stop frees the slot before
the next step, so a cancel, a timeout or a slow consumer costs the batch at most one step.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from services.common import Clock
from services.model.engine import (
    GenerationEngine,
    GenerationRequest,
    SequenceHandle,
    SlotsExhausted,
    StepOutput,
)
from services.priority import AgingPriorityQueue

log = logging.getLogger("spine.inference")

WAKE = object()  # put on a job's queue to wake its consumer; carries nothing


class JobFailure(Exception):
    """Why the scheduler stopped a job; `code` is the status its caller gets."""

    code = grpc.StatusCode.INTERNAL


class ComputeTimeout(JobFailure):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class ConsumerTooSlow(JobFailure):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class JobCancelled(JobFailure):
    code = grpc.StatusCode.CANCELLED


class ShuttingDown(JobFailure):
    code = grpc.StatusCode.UNAVAILABLE


class QueueFull(OverflowError):
    """Every KV slot is busy and `max_queue` requests already wait."""


@dataclass(eq=False)
class Job:
    """One request's place in the scheduler; its step outputs arrive on `out`.

    `buffer` bounds the outputs not yet taken by the consumer (0 = unbounded, for unary
    calls, whose consumer is the servicer itself: it gets all its outputs as one list on
    `out` when the job finishes); `budget_ms` is the compute budget, counted from
    admission into a slot (0 = none).
    """

    request: GenerationRequest
    priority: int = 0
    budget_ms: float = 0.0
    buffer: int = 0
    out: queue.Queue[Any] = field(init=False)
    handle: SequenceHandle | None = None
    cancelled: bool = False
    failure: BaseException | None = None
    enqueued_at: float = 0.0
    started_at: float | None = None
    admitted_seq: int | None = None
    tokens: int = 0
    done: bool = False  # its last output is on `out`
    held: list[StepOutput] = field(default_factory=list)  # a unary job's outputs until it finishes

    def __post_init__(self) -> None:
        self.out = queue.Queue(maxsize=self.buffer)


class Scheduler:
    """Owns the engine; admits waiting jobs by priority between steps; delivers tokens per job."""

    def __init__(self, engine: GenerationEngine, max_queue: int, *, aging_ms: float = 500.0,
                 clock: Clock = time.monotonic, streams: Callable[[int], Any] | None = None) -> None:
        self.engine = engine
        # On CUDA a step runs on the stream of the highest class in the batch (the device
        # context hands out a high-priority stream for the latency class); None on the CPU.
        self._streams = streams
        self.max_queue = max_queue
        self.clock = clock
        self._waiting: AgingPriorityQueue[Job] = AgingPriorityQueue(aging_ms)
        self._running: dict[int, Job] = {}  # by handle id
        self._cancels: list[Job] = []
        self._wake = threading.Condition()
        self._closed = False
        self._admissions = 0
        self.recent_admissions: deque[Job] = deque(maxlen=64)  # admission order, for tests and the bench
        self._thread = threading.Thread(target=self._loop, name="inference-scheduler", daemon=True)
        self._thread.start()

    # -- callers' side -------------------------------------------------------------
    def submit(self, job: Job) -> None:
        with self._wake:
            if self._closed:
                raise ShuttingDown("inference is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(
                    f"inference is at capacity: all {self.engine.max_slots} KV cache slots are busy and "
                    f"{len(self._waiting)} requests already wait (inference.max_queue = {self.max_queue}); "
                    "retry with backoff")
            job.enqueued_at = self.clock()
            self._waiting.push(job, job.priority, job.enqueued_at)
            self._wake.notify()

    def cancel(self, job: Job) -> None:
        """Stop `job`: a waiting one leaves the queue now, a running one before the next step."""
        with self._wake:
            if job.cancelled:
                return
            job.cancelled = True
            if job.handle is None and self._waiting.remove_if(lambda waiting: waiting is job):
                _fail(job, JobCancelled("generation cancelled"))
                return
            self._cancels.append(job)
            self._wake.notify()

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def running_count(self) -> int:
        return len(self._running)

    def close(self) -> None:
        with self._wake:
            self._closed = True
            for job in self._waiting.remove_if(lambda _: True):
                _fail(job, ShuttingDown("inference is shutting down"))
            self._wake.notify()
        self._thread.join(timeout=5.0)

    # -- the loop ------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._closed and not self._waiting and not self._running and not self._cancels:
                    self._wake.wait()
                if self._closed and not self._running and not self._waiting:
                    return
                cancels, self._cancels = self._cancels, []
            for job in cancels:
                self._stop(job, JobCancelled("generation cancelled"))
            self._expire()
            self._admit()
            if not self._running:
                continue
            try:
                with self._stream_for_batch():
                    outputs = self.engine.step()
            except Exception as error:  # the model failed: fail the running jobs, keep serving
                log.exception("decode step failed")
                for job in list(self._running.values()):
                    self._stop(job, error)
                continue
            for output in outputs:
                owner = self._running.get(output.handle.id)
                if owner is not None:
                    self._deliver(owner, output)

    def _deliver(self, job: Job, output: StepOutput) -> None:
        """Hand `output` to its job without ever waiting for the consumer.

        A unary job (no buffer bound) gets its outputs in one hand-off when it finishes:
        waking its consumer's thread for every token cost more CPU than the token itself
        on a busy host, and a unary caller cannot use a token before the last one anyway.
        """
        job.tokens += 1
        item: StepOutput | list[StepOutput] = output
        if not job.buffer:
            job.held.append(output)
            if not output.finished:
                return
            item, job.held = job.held, []
        try:
            job.out.put_nowait(item)
        except queue.Full:
            self._stop(job, ConsumerTooSlow(
                f"stream consumer too slow: {job.buffer} chunks were waiting unread "
                f"(inference.stream_buffer_chunks = {job.buffer}); generation stopped after "
                f"{job.tokens - 1} tokens to free its slot; read faster or use the unary call"))
            return
        if output.finished:
            job.done = True
            del self._running[output.handle.id]

    def _expire(self) -> None:
        now = self.clock()
        for job in list(self._running.values()):
            if job.budget_ms and job.started_at is not None and (now - job.started_at) * 1000.0 >= job.budget_ms:
                self._stop(job, ComputeTimeout(
                    f"compute budget of {job.budget_ms:.0f} ms (inference_timeout_ms) exceeded after "
                    f"{job.tokens} of {job.request.max_tokens} tokens; raise inference_timeout_ms "
                    "or lower max_tokens"))

    def _stream_for_batch(self) -> Any:
        """`torch.cuda.stream(...)` for the batch's highest class, or a no-op off CUDA."""
        stream = self._streams(max(job.priority for job in self._running.values())) if self._streams else None
        if stream is None:
            return contextlib.nullcontext()
        import torch

        return torch.cuda.stream(stream)

    def _admit(self) -> None:
        with self._wake:
            while self.engine.free_slots > 0:
                job = self._waiting.pop(self.clock())
                if job is None:
                    return
                if job.cancelled:
                    _fail(job, JobCancelled("generation cancelled"))
                    continue
                try:
                    job.handle = self.engine.submit(job.request)
                except SlotsExhausted:  # not expected: only this thread submits
                    self._waiting.push(job, job.priority, job.enqueued_at)
                    return
                except ValueError as error:
                    _fail(job, error)
                    continue
                job.started_at = self.clock()
                job.admitted_seq = self._admissions
                self._admissions += 1
                self.recent_admissions.append(job)
                self._running[job.handle.id] = job

    def _stop(self, job: Job, error: BaseException) -> None:
        """Free the job's slot now (if it has one) and tell its consumer why it ended."""
        if job.handle is not None and self._running.pop(job.handle.id, None) is not None:
            self.engine.cancel(job.handle)
        if job.failure is None and not job.done:
            _fail(job, error)


def _fail(job: Job, error: BaseException) -> None:
    job.failure = error
    try:
        job.out.put_nowait(WAKE)
    except queue.Full:
        pass  # the consumer has unread outputs; it sees the failure when it has read them
