"""The cache as its callers see it, wherever it runs: `Cache`, its items and results, and how
each operation crosses the wire (`LookupBatch`, `StoreBatch`).

Apart from the servicer (whose index keeps tensors): a gateway whose cache runs in another
process imports this and not torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from services.pipeline.batch_rpc import BatchRpc, ItemError, decode_answer, encode_answer
from services.pipeline.interface import NO_OPTIONS, CallOptions, Interface
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


STORE_BATCH: BatchRpc[StoreItem, bool, cache_pb2.CacheStoreBatchRequest, cache_pb2.CacheStoreBatchResponse] = BatchRpc(
    rpc="StoreBatch", method="store", encode_items=_encode_stores, decode_items=_decode_stores,
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


LOOKUP_BATCH: BatchRpc[LookupItem, Probe, cache_pb2.CacheLookupBatchRequest, cache_pb2.CacheLookupBatchResponse] = BatchRpc(
    rpc="LookupBatch", method="lookup", encode_items=_encode_lookups,
    decode_items=lambda request: [(item.tenant, item.request if item.HasField("request") else None)
                                  for item in request.items],
    encode_results=lambda probes: encode_answer(cache_pb2.CacheLookupBatchResponse(), probes, _fill_probe),
    decode_results=lambda answer: decode_answer(answer, _read_probe))


class Cache(Protocol):
    """Answers kept for identical requests: a probe before the model, a store after it."""

    def lookup(self, items: Sequence[LookupItem], options: CallOptions = NO_OPTIONS) -> list[Probe | ItemError]:
        """Whether each request may be cached, its key and, when there is one, the stored answer."""
        ...

    def store(self, items: Sequence[StoreItem], options: CallOptions = NO_OPTIONS) -> list[bool | ItemError]:
        """Keep each answer (False: not kept, e.g. a shadow copy's)."""
        ...


CACHE: Interface[Cache] = Interface("cache", [LOOKUP_BATCH, STORE_BATCH])
