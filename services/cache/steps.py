"""What the pipeline asks the cache and does with its answers: the lookup before the model, the
store after it, and the batch rpcs' items and codecs they share with `services.cache.service`.

Apart from the servicer (whose index keeps tensors): a gateway whose cache runs in another
process imports these and not torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.pipeline.batch_rpc import BatchRpc, decode_answer, encode_answer
from services.pipeline.state import RequestState
from services.pipeline.step import Phase, Step, StepCall
from wire.v1 import cache_pb2, generation_pb2

LookupItem = tuple[str, "generation_pb2.GenerateRequest | None"]  # (tenant, the routed request)


@dataclass(frozen=True, slots=True)
class Probe:
    """What the cache says about one request: whether it may be cached, its key, and the
    stored answer (marked `cached`) when there is one."""

    cacheable: bool
    key: bytes = b""
    hit: generation_pb2.GenerateResponse | None = None
    pregenerated: bool = False  # the hit came from the pre-generated table


NOT_CACHEABLE = Probe(cacheable=False)


@dataclass(slots=True)  # not frozen: see services.pipeline.batch_rpc
class StoreItem:
    """An answer to keep (the fields of `spine.v1.CacheStoreRequest`): under the lookup's
    `key`, or, without one, under the key of `request`."""

    tenant: str
    response: generation_pb2.GenerateResponse | None
    key: bytes = b""
    request: generation_pb2.GenerateRequest | None = None
    shadow: bool = False


def _encode_stores(items: Sequence[StoreItem]) -> cache_pb2.CacheStoreBatchRequest:
    request = cache_pb2.CacheStoreBatchRequest()
    for store in items:
        item = request.items.add(tenant=store.tenant, key=store.key, shadow=store.shadow)
        if store.response is not None:
            item.response.CopyFrom(store.response)
        if store.request is not None:
            item.request.CopyFrom(store.request)
    return request


def _decode_stores(request: cache_pb2.CacheStoreBatchRequest) -> list[StoreItem]:
    return [StoreItem(item.tenant, item.response if item.HasField("response") else None, item.key,
                      item.request if item.HasField("request") else None, item.shadow) for item in request.items]


def _fill_stored(response: cache_pb2.CacheStoreResponse, stored: bool) -> None:
    response.stored = stored


STORE_BATCH: BatchRpc[StoreItem, bool] = BatchRpc(
    rpc="StoreBatch", local="store_items", encode_items=_encode_stores, decode_items=_decode_stores,
    encode_results=lambda results: encode_answer(cache_pb2.CacheStoreBatchResponse(), results, _fill_stored),
    decode_results=lambda answer: decode_answer(answer, lambda response: response.stored))


def _encode_lookups(items: Sequence[LookupItem]) -> cache_pb2.CacheLookupBatchRequest:
    request = cache_pb2.CacheLookupBatchRequest()
    for tenant, generate in items:
        item = request.items.add(tenant=tenant)
        if generate is not None:
            item.request.CopyFrom(generate)
    return request


def _fill_probe(response: cache_pb2.CacheLookupResponse, probe: Probe) -> None:
    response.cacheable = probe.cacheable
    response.key = probe.key
    if probe.hit is not None:
        response.hit = True
        response.response.CopyFrom(probe.hit)
        response.pregenerated = probe.pregenerated


def _read_probe(found: cache_pb2.CacheLookupResponse) -> Probe:
    return Probe(cacheable=found.cacheable, key=found.key, hit=found.response if found.hit else None,
                 pregenerated=found.pregenerated)


LOOKUP_BATCH: BatchRpc[LookupItem, Probe] = BatchRpc(
    rpc="LookupBatch", local="lookup_items", encode_items=_encode_lookups,
    decode_items=lambda request: [(item.tenant, item.request if item.HasField("request") else None)
                                  for item in request.items],
    encode_results=lambda probes: encode_answer(cache_pb2.CacheLookupBatchResponse(), probes, _fill_probe),
    decode_results=lambda answer: decode_answer(answer, _read_probe))


class CacheLookupStep(Step):
    """The pipeline probes the cache before the model (fail open: a failure is a counted miss)."""

    method = "Lookup"
    order = 40

    def decide(self, batch: list[RequestState], call: StepCall) -> None:
        probes = call.batch(LOOKUP_BATCH, [(state.tenant, state.resolved) for state in batch])
        for state, probe in self.answered(call, batch, probes):
            state.cacheable = probe.cacheable
            state.cache_key = probe.key
            if probe.hit is not None:
                state.hit = probe.hit
                state.cached = True
                state.pregenerated = probe.pregenerated
                state.completion_tokens = probe.hit.completion_tokens


class CacheStoreStep(Step):
    """The pipeline keeps a fresh answer for the next identical request (fail open).

    Not for shadow copies (they must not change what clients are served), cache hits, or
    requests the lookup found not cacheable; the lookup's key travels back with the store."""

    method = "Store"
    phase = Phase.COMPLETE
    order = 60

    def wants(self, state: RequestState) -> bool:
        return (state.response is not None and state.resolved is not None and not state.shadow
                and state.cacheable is not False)

    def decide(self, batch: list[RequestState], call: StepCall) -> None:
        # With the lookup's key, or (the lookup failed) the request for the cache to key.
        stored = call.batch(STORE_BATCH, [StoreItem(state.tenant, state.response, state.cache_key,
                                                    None if state.cache_key else state.resolved) for state in batch])
        self.answered(call, batch, stored)
