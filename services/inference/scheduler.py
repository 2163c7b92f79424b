"""The inference scheduler: one thread owns the engine; jobs join and leave between decode steps.

Between two steps the scheduler, in this order: stops cancelled jobs, stops streams whose
reader has stopped reading, stops jobs past their compute budget, and admits waiting jobs
into free KV slots — highest priority class first, with aging so the lowest class never
starves (see `services.inference.priority`). Then it runs one batched step, measures it (the
`StepCost` every default budget and load hint is computed from) and hands each job its
token: a consumer on a thread through its job's queue, and consumers on an event loop all
together, one wake-up of their loop per step (`services.inference.loop_outbox`).

It never blocks on a consumer. A stream's reader is judged by time and memory, never by a
count of chunks a normal reader can reach on a busy host: it is stopped when outputs have
waited unread for `stream_idle_s`, or when what it leaves unread passes `stream_max_bytes`
— slot and KV cache freed at once — and told why; the other jobs in the batch go on at full
speed. Every stop frees the slot before the next step, so a cancel, a timeout or a slow
reader costs the batch at most one step.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from services.common import Clock
from services.common.log_limit import RateLimitedLog
from services.common.thread_names import name_os_thread
from services.inference.cost import BudgetRule, StepCost
from services.inference.cpu_placement import place_process
from services.inference.fair_share import SlotShares
from services.inference.jobs import (
    OUTPUT_BYTES,
    WAKE,
    ComputeTimeout,
    ConsumerTooSlow,
    Displaced,
    Job,
    JobCancelled,
    QueueFull,
    ShuttingDown,
    StepObserver,
)
from services.inference.loop_outbox import LoopOutbox, StepHandoff
from services.inference.model.engine import (
    GenerationEngine,
    SlotsExhausted,
    StepOutput,
)
from services.inference.priority import AgingPriorityQueue

log = logging.getLogger("spine.inference")
# A broken model fails every step: each traceback at DEBUG, at most one ERROR line a second.
_step_failures = RateLimitedLog(log, "failed decode steps", level=logging.ERROR)


class Scheduler:
    """Owns the engine; admits waiting jobs by priority between steps; delivers tokens per job."""

    def __init__(self, engine: GenerationEngine, max_queue: int, *, cost: StepCost, budget: BudgetRule,
                 aging_ms: float = 500.0, stream_idle_s: float = 10.0, stream_max_bytes: int = 1 << 20,
                 clock: Clock = time.monotonic, streams: Callable[[int], Any] | None = None,
                 observer: StepObserver | None = None, headroom_slots: int = 0) -> None:
        self.engine = engine
        self.observer = observer
        # The last free slots go only to a tenant running fewer than its share of the slots
        # (among the tenants active lately, `SlotShares`): a flooder never holds every slot, so
        # another tenant's request starts at the next step instead of waiting for one to free.
        self.headroom_slots = headroom_slots
        self._slot_shares = SlotShares()
        # On CUDA a step runs on the stream of the highest class in the batch (the device
        # context hands out a high-priority stream for the latency class); None on the CPU.
        self._streams = streams
        self.max_queue = max_queue
        self.cost = cost
        self.budget = budget
        self.stream_idle_s = stream_idle_s
        self.stream_max_bytes = stream_max_bytes
        self.clock = clock
        self._waiting: AgingPriorityQueue[Job] = AgingPriorityQueue(aging_ms)
        self._running: dict[int, Job] = {}  # by handle id
        self._cancels: list[Job] = []
        self._handoff = StepHandoff()  # this step's outputs for consumers on event loops
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
                self._make_room(job)
            job.enqueued_at = self.clock()
            job.submitted_pc = time.perf_counter()
            self._slot_shares.asked(job.tenant, job.weight, job.enqueued_at)
            self._waiting.push(job, job.priority, job.enqueued_at, job.tenant, job.weight)
            self._wake.notify()

    def _make_room(self, job: Job) -> None:
        """A full queue: displace the newest job of a tenant holding more than its share of
        `job`'s class, or refuse `job` (QueueFull). The caller holds the lock."""
        retry = self.retry_after_s()
        full = (f"inference is at capacity: all {self.engine.max_slots} KV cache slots are busy and "
                f"{len(self._waiting)} requests already wait (inference.max_queue = {self.max_queue})")
        victim = self._waiting.evict_for(job.priority, job.tenant, job.weight)
        if victim is None:
            raise QueueFull(f"{full}; retry after {retry:.3f}s", retry)
        _fail(victim, Displaced(f"{full}, tenant {victim.tenant!r} holding more than its share of them; "
                                f"retry after {retry:.3f}s", retry))

    def next_output(self, job: Job, timeout: float) -> Any:
        """The job's next item (a StepOutput, a unary job's list, or WAKE), or None after
        `timeout` seconds; taking one counts as reading (see the slow-reader rule)."""
        assert isinstance(job.out, queue.Queue)
        try:
            item = job.out.get(timeout=timeout)
        except queue.Empty:
            return None
        job.last_read = self.clock()
        return item

    async def next_output_on_loop(self, job: Job, timeout: float) -> Any:
        """`next_output` for a job whose consumer is on an event loop (its `out` a `LoopOutbox`)."""
        assert isinstance(job.out, LoopOutbox)
        item = await job.out.get(timeout)
        if item is not None:
            job.last_read = self.clock()
        return item

    def cancel(self, job: Job) -> None:
        """Stop `job`: a waiting one leaves the queue now, a running one before the next step."""
        with self._wake:
            if job.cancelled or job.done or job.failure is not None:
                return
            job.cancelled = True
            if job.handle is None and self._waiting.remove_if(lambda waiting: waiting is job):
                _fail(job, JobCancelled("generation cancelled"))
                return
            self._cancels.append(job)
            self._wake.notify()

    def retry_after_s(self) -> float:
        """When a queue place should free up: the first running sequence to finish, at the
        measured cost per token; one step when nothing runs yet."""
        running = tuple(self._running.values())  # a C-level copy: safe beside the loop thread
        ms = self.cost.ms_per_token(max(1, len(running)))
        left = min((job.request.max_tokens - job.tokens for job in running), default=1)
        return max(0.001, left * ms / 1000.0)

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    def queue_by_class(self) -> dict[int, int]:
        """Waiting requests per priority class (for /metrics)."""
        with self._wake:
            return self._waiting.depth_by_class()

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
        name_os_thread()  # `top -H` and the bench tell the decode loop from the handlers
        place_process()  # the whole process on a CPU of its own, when it asked (services.inference.cpu_placement)
        while True:
            started = time.perf_counter()
            with self._wake:
                while not self._closed and not self._waiting and not self._running and not self._cancels:
                    self._wake.wait()
                    started = time.perf_counter()  # time spent idle is no step's cost
                if self._closed and not self._running and not self._waiting:
                    return
                cancels, self._cancels = self._cancels, []
            for job in cancels:
                self._stop(job, JobCancelled("generation cancelled"))
            self._check_readers()
            self._expire()
            self._admit()
            if not self._running:
                continue
            try:
                with self._stream_for_batch():
                    outputs = self.engine.step()
            except Exception as error:  # the model failed: fail the running jobs, keep serving
                _step_failures(None, "decode step failed (%d request(s) ended): %r", len(self._running), error,
                               exc_info=True)
                for job in list(self._running.values()):
                    self._stop(job, error)
                continue
            now, produced = self.clock(), time.perf_counter()
            ttfts: list[float] = []
            itls: list[float] = []
            for output in outputs:
                owner = self._running.get(output.handle.id)
                if owner is not None:
                    if owner.tokens == 0:
                        ttfts.append(produced - owner.submitted_pc)
                        owner.first_token_pc = produced
                    else:
                        itls.append(produced - owner.last_token_pc)
                    owner.last_token_pc = produced
                    self._deliver(owner, output, now)
            self._handoff.flush()
            self.cost.observe(len(outputs), time.perf_counter() - started)
            if self.observer is not None:
                self.observer.step(len(outputs), ttfts, itls)

    def _deliver(self, job: Job, output: StepOutput, now: float) -> None:
        """Hand `output` to its job without ever waiting for the consumer.

        A unary job gets its outputs in one hand-off when it finishes: waking its
        consumer's thread for every token cost more CPU than the token itself on a busy
        host, and a unary caller cannot use a token before the last one anyway.
        """
        job.tokens += 1
        item: StepOutput | list[StepOutput] = output
        if not job.stream:
            job.held.append(output)
            if not output.finished:
                return
            item, job.held = job.held, []
        elif job.out.empty():
            job.unread_since = now
        if isinstance(job.out, LoopOutbox):
            self._handoff.deliver(job.out, item)  # its loop is woken once, when the step is out
        else:
            job.out.put_nowait(item)
        if output.finished:
            job.done = True
            del self._running[output.handle.id]
            self._slot_shares.ended(job.tenant)
        elif job.stream and (job.out.qsize() + 1) * OUTPUT_BYTES > self.stream_max_bytes:
            self._stop(job, self._too_slow(job, f"more than {self.stream_max_bytes} bytes of output were "
                                                f"waiting unread (inference.stream_buffer_max_bytes)"))

    def _check_readers(self) -> None:
        """Stop every stream whose outputs have waited unread for `stream_idle_s`."""
        now = self.clock()
        for job in list(self._running.values()):
            if job.stream and not job.out.empty():
                idle = now - max(job.last_read, job.unread_since)
                if idle >= self.stream_idle_s:
                    self._stop(job, self._too_slow(
                        job, f"nothing was read for {idle:.1f} s while output waited "
                             f"(inference.stream_idle_timeout_s = {self.stream_idle_s:g})"))

    def _too_slow(self, job: Job, why: str) -> ConsumerTooSlow:
        return ConsumerTooSlow(
            f"stream consumer too slow: {why}; generation stopped after {job.tokens} tokens to free "
            f"its slot ({job.out.qsize()} unread); read faster or use the unary call")

    def _expire(self) -> None:
        if not self._running:
            return
        now = self.clock()
        # A default budget follows the measured cost up (a busier host, a bigger batch) and
        # never down, so a job admitted on a quiet host is not cut short when load arrives.
        default_ms = self.budget.for_cost(self.cost.ms_per_token(len(self._running)))
        for job in list(self._running.values()):
            if job.default_budget:
                job.budget_ms = max(job.budget_ms, default_ms(job.request.max_tokens))
            if job.budget_ms and job.started_at is not None and (now - job.started_at) * 1000.0 >= job.budget_ms:
                kind = "the default, from the measured cost per token" if job.default_budget else \
                    "inference_timeout_ms"
                self._stop(job, ComputeTimeout(
                    f"compute budget of {job.budget_ms:.0f} ms ({kind}) exceeded after "
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
                reserved = self.engine.free_slots <= self.headroom_slots
                job = self._waiting.pop(self.clock(), self._below_share if reserved else None)
                if job is None:
                    return
                if job.cancelled:
                    _fail(job, JobCancelled("generation cancelled"))
                    continue
                try:
                    job.handle = self.engine.submit(job.request)
                except SlotsExhausted:  # not expected: only this thread submits
                    self._waiting.push(job, job.priority, job.enqueued_at, job.tenant, job.weight)
                    return
                except ValueError as error:
                    _fail(job, error)
                    continue
                job.started_at = job.last_read = self.clock()
                job.admitted_seq = self._admissions
                self._admissions += 1
                self.recent_admissions.append(job)
                self._running[job.handle.id] = job
                self._slot_shares.started(job.tenant)

    def _below_share(self, job: Job) -> bool:
        return self._slot_shares.below_share(job.tenant, job.weight, self.engine.max_slots, self.clock())

    def _stop(self, job: Job, error: BaseException) -> None:
        """Free the job's slot now (if it has one) and tell its consumer why it ended."""
        if job.handle is not None and self._running.pop(job.handle.id, None) is not None:
            self._slot_shares.ended(job.tenant)
            self.engine.cancel(job.handle)
        if job.failure is None and not job.done:
            _fail(job, error)


def _fail(job: Job, error: BaseException) -> None:
    job.failure = error
    job.out.put_nowait(WAKE)  # after what was delivered: the consumer reads that first
