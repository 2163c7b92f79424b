"""Which of the gateway's steps are batched, as the components move.

With `batching.enabled`, whatever is local is also batched: admission (auth, ratelimit,
router and cache all local) and completion (metrics and logs local) are decided per
micro-batch (`monolith.batched_pipeline`) instead of one call per request. `attach` is called at
start and after every move, and picks the admission and completions that fit the placements
now; the gateway, given this object when it is made, asks it for them on each request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from monolith.batched_pipeline import BatchedAdmission, BatchingConfig, DeferredCompletions
from runtime.placement.components import Components
from services.gateway.steps import Admission, Completions, DirectSteps, InFlight
from services.inference.priority import DEFAULT as DEFAULT_PRIORITY
from services.pipeline.pipeline import Pipeline
from services.pipeline.state import RequestState
from services.pipeline.step import Step


class GatewayBatching:
    """The gateway's admission and completions: batched where the components are local."""

    def __init__(self, in_flight: InFlight, pipeline: Pipeline, components: Components,
                 batching: BatchingConfig) -> None:
        self.in_flight = in_flight
        self.pipeline = pipeline
        self.components = components
        self.batching = batching
        self.batched_admission: BatchedAdmission | None = None
        self.deferred: DeferredCompletions | None = None
        self._direct = DirectSteps(pipeline)  # what runs where nothing is batched
        # What the gateway runs now (`services.gateway.steps.Steps`), swapped whole by `attach`.
        self._current: tuple[Admission, Completions] = (self._direct.admission, self._direct.completions)
        self._in_process = False  # set by `attach`
        self._on_loop = False  # set by `attach`

    @property
    def admission(self) -> Admission:
        return self._current[0]

    @property
    def in_process(self) -> bool:
        """Whether an event loop may run this request's admission and completions inline
        (`Gateway.generate_on_loop`): every stage's component is in this process (its
        decisions are CPU work of microseconds; what stores they keep is renewed off the
        request path), and batching is on, so the completions' writes (logs, cache, metrics)
        are handed to the writer thread rather than made in the request's."""
        return self._in_process

    @property
    def on_loop(self) -> bool:
        """Whether an event loop may run this request's steps at all (`Steps.on_loop`): inline
        where `in_process`; else through the loop bridge, where every admission step's component
        is in this process (and admission is not batched with remote ones) or awaited on the
        loop, and every completion step's is awaited on the loop or, with batching on, in this
        process (its writes handed to the writer thread; a lease's release is CPU work)."""
        return self._on_loop

    @property
    def completions(self) -> Completions:
        return self._current[1]

    def attach(self) -> None:
        """Batch the steps whose components are local now (or all, with batching.remote);
        the others go per request."""
        in_flight, pipeline, batching = self.in_flight, self.pipeline, self.batching
        placements = self.components.placements
        batched_admission = all(batching.batches(placements[step.component])
                                for step in pipeline.admission if step.component)
        if batched_admission:
            if self.batched_admission is None:
                self.batched_admission = BatchedAdmission(pipeline, batching, expected=lambda: in_flight.count,
                                                          patient=self.model_backlogged)
            self._current = (self.batched_admission, self._current[1])
        elif self.batched_admission is not None:
            # New requests go per request first; then those already inside finish in the batcher.
            retired, self.batched_admission = self.batched_admission, None
            self._current = (self._direct.admission, self._current[1])
            retired.close()
        deferred = frozenset(step.name for step in pipeline.completion
                             if step.deferrable and batching.batches(placements[step.component]))
        if self.deferred is not None and {s.name for s in self.deferred.deferred} != deferred:
            self._close_completions()  # what it holds is written where it was meant to go
        if deferred and self.deferred is None:
            self.deferred = DeferredCompletions(
                pipeline, deferred, interval_s=batching.completion_interval_ms / 1000.0,
                busy=lambda: in_flight.count > 0)
            metrics = self.components.local_servicers.get("metrics")
            if metrics is not None:  # a scrape counts what was handed over first
                metrics.read_hooks.add(self.deferred.drain)
        self._current = (self._current[0], self.deferred if self.deferred is not None else self._direct.completions)
        self._in_process = batching.enabled and all(placements[step.component] == "local"
                                                    for step in (*pipeline.admission, *pipeline.completion)
                                                    if step.component)
        self._on_loop = self._in_process or self._bridgeable(batched_admission)

    def _bridgeable(self, batched_admission: bool) -> bool:
        """Whether every step can run through the loop bridge as placed now (`on_loop`)."""
        pipeline, placements, enabled = self.pipeline, self.components.placements, self.batching.enabled

        def awaited(step: Step[Any]) -> bool:
            return step.interface is not None and bool(
                getattr(pipeline.components.get(step.interface), "awaits_on_loop", False))

        for step in pipeline.admission:
            if step.component and not (placements[step.component] == "local" or
                                       (not batched_admission and awaited(step))):
                return False
        return all(awaited(step) or (enabled and placements[step.component] == "local")
                   for step in pipeline.completion if step.component)

    def _close_completions(self) -> None:
        if self.deferred is None:
            return
        self.deferred.close()
        metrics = self.components.local_servicers.get("metrics")
        if metrics is not None:
            metrics.read_hooks.remove(self.deferred.drain)
        self.deferred = None

    def drain(self) -> None:
        """Write what finished requests handed over (before reading metrics, logs or the cache)."""
        if self.deferred is not None:
            self.deferred.drain()

    def model_backlogged(self, states: Sequence[RequestState]) -> bool:
        """Whether admission may wait to batch more requests: only while the models these
        requests name run here with a full batch queued, so admitted a few ms later they
        lose no model time — and never for the latency class, which the model's queue lets
        ahead of that backlog."""
        inference = self.components.local_inference()
        if inference is None:
            return False
        models = set()  # one pass: the batcher asks this several times per request under load
        for state in states:
            request = state.request
            if request.priority > DEFAULT_PRIORITY:
                return False
            models.add(request.model)
        return bool(inference.backlogged(models))

    def close(self) -> None:
        """Stop batching: requests inside finish, what completions hold is written."""
        if self.batched_admission is not None:
            self.batched_admission.close()
            self.batched_admission = None
        self._close_completions()
