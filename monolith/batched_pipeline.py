"""The spine's scheduling of the pipeline: admission per micro-batch, completions off the path.

The steps are the pipeline's (`services.pipeline`), the same ones the layered gateway
runs with a batch of one; only when they run changes here:

- `BatchedAdmission`: concurrent requests that arrive within a short window are admitted
  together, each admission step calling its component's batch rpc once per batch (one
  credential check, one route lookup, one rate-limit decision in arrival order, one cache
  probe). A lone request is decided at once in its own thread; requests served on an event
  loop are batched there, a pass of the loop at a time (`monolith.loop_batcher`).
- `DeferredCompletions`: a finished request hands its state over and its answer goes out
  at once; the completion steps (cache store, logs, metrics) run a window at a time on a
  folder thread. On a CPU host, writing them in the request's own thread cost more than
  the rest of the middleware together.

Nothing handed over is unseen or lost: an answer handed over for the cache is stored
before any later lookup of the same request (a pipeline barrier), `drain` writes
everything before a reader looks (the runtime calls it before a scrape or a log flush),
and `close` drains what is left at shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable, Collection, Sequence
from typing import Annotated, Any

import grpc
from pydantic import Field, StrictBool, StrictInt

from monolith.batcher import BatcherClosed, BatchStats, MicroBatcher
from monolith.loop_batcher import LoopBatcher
from services.common.config_section import Float, Section
from services.common.log_limit import RateLimitedLog
from services.common.thread_names import name_os_thread
from services.pipeline.pipeline import Pipeline
from services.pipeline.state import RequestState
from services.pipeline.step import Step
from services.pipeline.verdicts import Stop

log = logging.getLogger("spine.pipeline")
# A store that keeps failing is retried every fold: at most one ERROR line a second.
_fold_failures = RateLimitedLog(log, "failed completion writes", level=logging.ERROR)

STORE_STEP = "cache.store"
LOOKUP_STEP = "cache.lookup"


class BatchingConfig(Section):
    """The `batching` section: whether and how the pipeline batches."""

    where = "batching"

    enabled: StrictBool = True
    # Also batch calls to components in other processes (one batch rpc per hop per batch).
    # Off by default: the layered layout then makes one call per request per hop, as a
    # layered stack does; `make bench` measures it on (`layered-batched`).
    remote: StrictBool = False
    max_batch: Annotated[StrictInt, Field(ge=1, le=4096)] = 32
    # How long a batch's leader may wait for more requests, and only while that wait is free:
    # more requests are in flight than queued, none of them is of the latency class, and the
    # models they name already have a full batch queued (so admitted a few ms later they
    # lose no model time). Without a backlog the leader decides at once: a lone request, or
    # 16 clients on 16 KV slots, never waits. With one (64 clients on one core), admission
    # on the core the model's steps share went in batches of one, each step starting on
    # caches the step had just used; with the wait (small batches), the handlers' CPU per
    # request fell in every focused A/B at high concurrency (`python -m bench.variants --vary
    # batching.max_wait_us=0,10000` repeats it), and throughput did not fall. Longer waits
    # formed no larger batches worth having.
    # Waits without the backlog rule (on every batch) never paid: a sleeping
    # leader is one more hand-off per batch. Nor did a yield instead of a wait (tried at
    # moderate concurrency, where nothing queues on one CPU: a leader about to decide alone
    # while others were in flight queued itself and called os.sched_yield, so handlers already
    # runnable joined its batch): batches formed and the handlers' CPU per request fell, but
    # the decode loop's rose by about as much (it stepped with fewer requests admitted);
    # throughput did not move past the noise.
    max_wait_us: Annotated[Float, Field(ge=0, le=100_000)] = 10_000.0
    # How often finished requests' completions are written, a window at a time, off the
    # request path; readers and shutdown never wait for it. A longer window cuts the writer's
    # CPU per request, but in A/Bs the saving was lost in the handlers' noise and throughput
    # did not move, while a longer window keeps more answered requests unwritten: not changed.
    completion_interval_ms: Annotated[Float, Field(ge=1, le=10_000)] = 50.0

    def batches(self, placement: str) -> bool:
        """Whether a step whose component has `placement` is batched."""
        return self.enabled and (placement == "local" or self.remote)


class BatchedAdmission:
    """The gateway's `Admission` for the spine: the admission steps, a micro-batch at a time."""

    def __init__(self, pipeline: Pipeline, config: BatchingConfig, *,
                 expected: Callable[[], int] | None = None,
                 patient: Callable[[Sequence[RequestState]], bool] | None = None) -> None:
        self.pipeline = pipeline
        self.config = config
        self._expected = expected
        self._patient = patient
        self.batcher: MicroBatcher[RequestState, None] = MicroBatcher(
            self._decide, max_batch=config.max_batch, max_wait_s=config.max_wait_us / 1e6, expected=expected,
            patient=patient)
        # Requests served on an event loop (the HTTP API's) are batched on that loop, a pass
        # of it at a time (`monolith.loop_batcher`): one batcher per loop, made at its first request.
        self._on_loops: dict[asyncio.AbstractEventLoop, LoopBatcher[RequestState, None]] = {}
        self._closed = False

    def admit(self, state: RequestState) -> None:
        if self.pipeline.hooks:  # the batch may be decided on another request's thread
            state.trace = self.pipeline.capture()
        try:
            self.batcher.submit(state)
        except BatcherClosed:
            raise Stop(grpc.StatusCode.UNAVAILABLE, "the spine is shutting down; retry on another replica") from None
        if state.outcome is not None:
            raise state.outcome

    async def admit_on_loop(self, state: RequestState) -> None:
        if self.pipeline.hooks:  # the batch may be decided in another request's turn
            state.trace = self.pipeline.capture()
        try:
            await self._loop_batcher().submit(state)
        except BatcherClosed:
            raise Stop(grpc.StatusCode.UNAVAILABLE, "the spine is shutting down; retry on another replica") from None
        if state.outcome is not None:
            raise state.outcome

    def _loop_batcher(self) -> LoopBatcher[RequestState, None]:
        loop = asyncio.get_running_loop()
        batcher = self._on_loops.get(loop)
        if batcher is None:
            batcher = LoopBatcher(loop, self._decide, max_batch=self.config.max_batch,
                                  max_wait_s=self.config.max_wait_us / 1e6, expected=self._expected,
                                  patient=self._patient)
            if self._closed:
                batcher.close()
            self._on_loops[loop] = batcher
        return batcher

    @property
    def stats(self) -> BatchStats:
        """Every batch decided so far, on threads and on event loops together."""
        total = BatchStats()
        for stats in (self.batcher.stats, *(batcher.stats for batcher in list(self._on_loops.values()))):
            total = total.plus(stats)
        return total

    def _decide(self, batch: list[RequestState]) -> list[None]:
        self.pipeline.admit(batch)
        return [None] * len(batch)

    def close(self) -> None:
        """Refuse new requests; those already queued are still decided."""
        self._closed = True
        self.batcher.close()
        for batcher in list(self._on_loops.values()):
            batcher.close()


def _identity(state: RequestState) -> tuple[Any, ...]:
    """What makes two requests the same cache entry, as the pipeline sees it (the cache's own
    key is a hash of the same fields)."""
    request = state.resolved
    assert request is not None
    seed = request.seed if request.HasField("seed") else None
    return (state.tenant, request.model, request.prompt, request.max_tokens, request.temperature, seed)


class DeferredCompletions:
    """The gateway's `Completions` for the spine: the `deferred` completion steps run a
    window at a time on a folder thread; the others (components still in another process,
    unless batching.remote) run at once for each request, as in the layered gateway."""

    def __init__(self, pipeline: Pipeline, deferred: Collection[str], *, max_batch: int = 256,
                 interval_s: float = 0.05, busy: Callable[[], bool] | None = None) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch: must be >= 1, got {max_batch}")
        self.pipeline = pipeline
        # A step that is not `deferrable` (a concurrency slot's release) runs at once even
        # when its component is local.
        self.deferred: list[Step[Any]] = [s for s in pipeline.completion if s.name in deferred and s.deferrable]
        self.direct: list[Step[Any]] = [s for s in pipeline.completion if s not in self.deferred]
        self._store = next((s for s in self.deferred if s.name == STORE_STEP), None)
        self._writes = [s for s in self.deferred if s is not self._store]
        self.max_batch = max_batch
        self.interval_s = interval_s
        # When nothing else is in flight the folder writes at once, in the gap before the
        # next request (a lone client never finds work waiting); under load it waits for
        # `interval_s` so a window holds many requests.
        self._busy = busy or (lambda: True)
        self._pending: deque[RequestState] = deque()
        # Answers handed over for the cache and not yet stored, by what makes them the same
        # entry (`_identity`), each key's in arrival order: a lookup takes the ones it needs
        # by key, whatever else is waiting (it used to rebuild a queue of every one of them).
        self._stores: dict[tuple[Any, ...], list[RequestState]] = {}
        self._stores_lock = threading.Lock()  # the dict; `_store_lock` serializes the writes
        # Past this many waiting, a finishing request writes them itself: memory stays
        # bounded and a stalled writer slows the callers down again instead of piling up.
        self._backlog_limit = 8 * max_batch
        self._store_lock = threading.Lock()
        self._drain_lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self.windows = 0
        if self._store is not None:
            pipeline.add_barrier(LOOKUP_STEP, self._store_matching)
        self._thread = threading.Thread(target=self._fold, name="spine-completions", daemon=True)
        self._thread.start()

    def complete(self, state: RequestState) -> None:
        if self.direct:
            self.pipeline.complete([state], self.direct)
        for step in self.deferred:  # spans and faults in the request's own thread
            self.pipeline.mark(step, state)
        if self._store is not None and self._store.wants(state) and self._store.name not in state.skip:
            identity = _identity(state)
            with self._stores_lock:
                self._stores.setdefault(identity, []).append(state)
        self._pending.append(state)
        if self._closed:  # a straggler after shutdown began: written now
            self.drain()
        elif len(self._pending) >= self._backlog_limit:
            self.drain()  # the writes fall behind (a stalled log file?): wait for them
        elif len(self._pending) >= self.max_batch or not self._busy():
            self._wake_after_answer()

    def _wake_after_answer(self) -> None:
        """Wake the folder; on an event loop (the HTTP front's, which sends the answer after
        this returns, in the same step), only once the answer is out. Why: woken now, the
        folder takes the interpreter lock for its writes while the loop still has the answer
        to send. The request is handed over either way, so `drain` writes it all the same."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a handler thread: its answer goes out on another thread anyway
            self._wake.set()
            return
        loop.call_soon(self._wake.set)

    def drain(self) -> None:
        """Write everything handed over so far; returns once it is in the cache, the metrics
        tables and the log ring, also when another thread was writing."""
        self._store_all()
        with self._drain_lock:
            left = len(self._pending)  # what was handed over before this call
            while left > 0:
                window = [self._pending.popleft() for _ in range(min(self.max_batch, left))]
                left -= len(window)
                self.windows += 1
                self.pipeline.complete(window, self._writes, hooks=False, timed=False)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        """Stop the folder and write what is left; later stragglers are written at once."""
        self._closed = True
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        self.drain()
        self.pipeline.remove_barrier(LOOKUP_STEP, self._store_matching)

    # -- the cache's answers ---------------------------------------------------------------
    def _store_matching(self, lookups: list[RequestState]) -> None:
        """Before a lookup: answers handed over for the same requests go in first (a repeated
        request still hits). Only those: the folder writes the rest, off the request path."""
        if not self._stores:
            with self._store_lock:  # another thread may be storing them right now
                return
        wanted = {_identity(state) for state in lookups}
        self._store_all(wanted)

    def _store_all(self, wanted: set[tuple[Any, ...]] | None = None) -> None:
        if self._store is None:
            return
        with self._store_lock:  # also when nothing waits: another thread may be storing them
            with self._stores_lock:
                if wanted is None:
                    states = [state for waiting in self._stores.values() for state in waiting]
                    self._stores.clear()
                else:  # the others stay where they are
                    states = [state for key in wanted for state in self._stores.pop(key, ())]
            if states:
                self.pipeline.run(self._store, states, hooks=False, timed=False)
                for state in states:
                    state.skip = state.skip | {STORE_STEP}

    def _fold(self) -> None:
        name_os_thread()
        while not self._closed:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            try:
                self.drain()
            except Exception:  # never let the folder die: readers and close still drain
                _fold_failures(None, "writing finished requests' completions failed; retrying", exc_info=True)
