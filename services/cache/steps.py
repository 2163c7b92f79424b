"""The cache's steps: the lookup before the model, the store after it."""

from __future__ import annotations

from services.cache.api import CACHE, Cache, StoreItem
from services.pipeline.state import RequestState
from services.pipeline.step import Phase, Step, StepCall


class CacheLookupStep(Step[Cache]):
    """The pipeline probes the cache before the model (fail open: a failure is a counted miss)."""

    interface = CACHE
    method = "Lookup"

    def wants(self, state: RequestState) -> bool:
        return state.open and not _whole_request_stream(state)

    def decide(self, batch: list[RequestState], call: StepCall[Cache]) -> None:
        probes = call.component.lookup([(state.tenant, state.resolved) for state in batch], call.options)
        for state, probe in self.answered(call, batch, probes):
            state.cacheable = probe.cacheable
            state.cache_key = probe.key
            if probe.hit is not None:
                state.hit = probe.hit
                state.cached = True
                state.pregenerated = probe.pregenerated
                state.completion_tokens = probe.hit.completion_tokens


class CacheStoreStep(Step[Cache]):
    """The pipeline keeps a fresh answer for the next identical request (fail open).

    Not for shadow copies (they must not change what clients are served), cache hits, or
    requests the lookup found not cacheable; the lookup's key travels back with the store."""

    interface = CACHE
    method = "Store"
    phase = Phase.COMPLETE

    def wants(self, state: RequestState) -> bool:
        return (state.response is not None and state.resolved is not None and not state.shadow
                and state.cacheable is not False and not _whole_request_stream(state))

    def decide(self, batch: list[RequestState], call: StepCall[Cache]) -> None:
        # With the lookup's key, or (the lookup failed) the request for the cache to key.
        stored = call.component.store([StoreItem(state.tenant, state.response, state.cache_key,
                                                 None if state.cache_key else state.resolved) for state in batch],
                                      call.options)
        self.answered(call, batch, stored)


def _whole_request_stream(state: RequestState) -> bool:
    """A stream of a request that carries its client's whole body: its answer is the engine's
    own events (tool-call deltas, logprobs), which a cached whole answer cannot replay as they
    were sent, and which a cached entry of its text alone would lose. Such streams neither read
    nor fill the cache; their unary twins do (keyed on the whole body)."""
    return state.streamed and bool(state.request.api)
