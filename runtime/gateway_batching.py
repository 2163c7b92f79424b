"""Which of the gateway's steps are batched, as the components move.

With `batching.enabled`, whatever is local is also batched: admission (auth, ratelimit,
router and cache all local) and completion (metrics and logs local) are decided per
micro-batch (`monolith.batched`) instead of one call per request. `attach` is called at
start and after every move, and hands the gateway the admission and completions that fit
the placements now.
"""

from __future__ import annotations

from collections.abc import Sequence

from monolith.batched import BatchedAdmission, BatchingConfig, DeferredCompletions
from runtime.components import Components
from services.gateway.service import DirectAdmission, DirectCompletions, Gateway
from services.inference.priority import DEFAULT as DEFAULT_PRIORITY
from services.pipeline.pipeline import Pipeline
from services.pipeline.state import RequestState


class GatewayBatching:
    """The gateway's admission and completions: batched where the components are local."""

    def __init__(self, gateway: Gateway, pipeline: Pipeline, components: Components, batching: BatchingConfig) -> None:
        self.gateway = gateway
        self.pipeline = pipeline
        self.components = components
        self.batching = batching
        self.admission: BatchedAdmission | None = None
        self.completions: DeferredCompletions | None = None

    def attach(self) -> None:
        """Batch the steps whose components are local now (or all, with batching.remote);
        the others go per request."""
        gateway, pipeline, batching = self.gateway, self.pipeline, self.batching
        placements = self.components.placements
        batched_admission = all(batching.batches(placements[step.component])
                                for step in pipeline.admission if step.component)
        if batched_admission:
            if self.admission is None:
                self.admission = BatchedAdmission(pipeline, batching, expected=lambda: gateway.in_flight,
                                                  patient=self.model_backlogged)
            gateway.admission = self.admission
        else:
            if self.admission is not None:
                self.admission.close()  # requests already inside finish there
                self.admission = None
            gateway.admission = DirectAdmission(pipeline)
        deferred = frozenset(step.name for step in pipeline.completion
                             if step.deferrable and batching.batches(placements[step.component]))
        if self.completions is not None and {s.name for s in self.completions.deferred} != deferred:
            self._close_completions()  # what it holds is written where it was meant to go
        if deferred and self.completions is None:
            self.completions = DeferredCompletions(
                pipeline, deferred, interval_s=batching.completion_interval_ms / 1000.0,
                busy=lambda: gateway.in_flight > 0)
            metrics = self.components.local_servicers.get("metrics")
            if metrics is not None:  # a scrape counts what was handed over first
                metrics.read_hooks.add(self.completions.drain)
        gateway.completions = self.completions if self.completions is not None else DirectCompletions(pipeline)

    def _close_completions(self) -> None:
        if self.completions is None:
            return
        self.completions.close()
        metrics = self.components.local_servicers.get("metrics")
        if metrics is not None:
            metrics.read_hooks.remove(self.completions.drain)
        self.completions = None

    def drain(self) -> None:
        """Write what finished requests handed over (before reading metrics, logs or the cache)."""
        if self.completions is not None:
            self.completions.drain()

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
        if self.admission is not None:
            self.admission.close()
            self.admission = None
        self._close_completions()
