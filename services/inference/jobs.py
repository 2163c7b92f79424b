"""A request's place in the scheduler (`Job`) and the ways the scheduler ends one.

Apart from the scheduler because both sides read them: the scheduler fills a job's record
and fails it with one of these; the servicer submits jobs, waits on their `out` queue and
turns a failure into its caller's status code (`JobFailure.code`).
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from services.inference.model.engine import GenerationRequest, SequenceHandle, StepOutput

WAKE = object()  # put on a job's queue to wake its consumer; carries nothing


# What one unread step output of a stream holds in memory: the StepOutput, its place in
# the queue and the int it carries (tracemalloc over 10,000 of them: ~145 bytes each),
# with room for the chunk the servicer makes of it.
OUTPUT_BYTES = 256


class Outbox(Protocol):
    """Where a job's outputs go: a `queue.Queue` for a consumer on a thread, a
    `services.inference.loop_outbox.LoopOutbox` for one on an event loop."""

    def put_nowait(self, item: Any) -> None: ...

    def empty(self) -> bool: ...

    def qsize(self) -> int: ...


class StepObserver(Protocol):
    """Told about every step (the serving metrics: `services.inference.serving_metrics.ServingStats`)."""

    def step(self, batch: int, ttfts: list[float], itls: list[float]) -> None: ...


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


class Displaced(JobFailure):
    """A waiting job whose place in a full queue went to another tenant's request (its own
    tenant held more than its share of the queue: `services.inference.fair_share`)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueFull(OverflowError):
    """Every KV slot is busy and `max_queue` requests already wait; `retry_after_s` is when
    the first place in the queue is expected to free up."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(eq=False)
class Job:
    """One request's place in the scheduler; its step outputs arrive on `out`.

    A `stream` job gets each output as it comes; a unary one (the servicer itself is its
    consumer) gets all of them as one list on `out` when it finishes. `budget_ms` is the
    compute budget, counted from admission into a slot; with `default_budget` the
    scheduler sets it (and only ever raises it) from the measured step cost.
    """

    request: GenerationRequest
    priority: int = 0
    budget_ms: float = 0.0
    default_budget: bool = False
    stream: bool = False
    out: Outbox = field(default_factory=queue.Queue)
    handle: SequenceHandle | None = None
    cancelled: bool = False
    failure: BaseException | None = None
    enqueued_at: float = 0.0
    started_at: float | None = None
    admitted_seq: int | None = None
    tokens: int = 0
    done: bool = False  # its last output is on `out`
    held: list[StepOutput] = field(default_factory=list)  # a unary job's outputs until it finishes
    last_read: float = 0.0  # when the consumer last took an output (scheduler clock)
    unread_since: float = 0.0  # when an output last went into an empty `out`
    submitted_pc: float = 0.0  # perf_counter at submit, at its first and at its last token: TTFT and ITL
    first_token_pc: float = 0.0
    last_token_pc: float = 0.0
    # Whose request it is and that tenant's weight: jobs of one class are admitted by tenant,
    # in proportion to the weights (`services.inference.fair_share`); "" and 1: no tenant.
    tenant: str = ""
    weight: float = 1.0
