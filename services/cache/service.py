"""The Cache service: answers for deterministic requests, kept per tenant for a while.

Only a request whose answer is fixed by its inputs is cacheable: greedy decoding
(temperature 0) or a set seed. The key is sha256 over (tenant, resolved model, prompt,
max_tokens, temperature, seed[, system prompt]), so tenants never see each other's entries
and a different parameter — a different system prompt included — is a different entry. Priority and timeouts change when an answer comes, not
what it is, so they are not part of the key.

`LookupBatch` probes a whole micro-batch in one tensor op (see `services/cache/index.py`)
and `StoreBatch` keeps many answers under one lock; the per-request `Lookup` and `Store`
are their batches of one.

Before the TTL index, a greedy request is looked up in the pre-generated table
(`cache.pregenerated`, `services.cache.pregenerated_answers`), shared by every tenant: its answer
is the model's own, written by `spine cache build`, and comes back marked `cached`. A lookup returns each cacheable request's key, and a store may
send it back instead of the request, so an answer is keyed once. Shadow stores are
refused so that shadow traffic can never change what clients are served.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Sequence
from typing import Any

import grpc
import orjson

from services.cache.api import LOOKUP_BATCH, NOT_CACHEABLE, STORE_BATCH, LookupItem, Probe, StoreItem
from services.cache.config import CacheConfig
from services.cache.index import CacheIndex, KeyHash, default_key_hash
from services.cache.pregenerated import served_digests
from services.cache.pregenerated_answers import PregeneratedAnswers
from services.common import (
    Clock,
    DeviceState,
)
from services.inference.config import InferenceConfig
from services.pipeline.batch_rpc import ItemError
from services.pipeline.interface import NO_OPTIONS, CallOptions
from wire.v1 import cache_pb2, cache_pb2_grpc, generation_pb2

KEY_BYTES = 32  # sha256


class InvalidCacheRequest(ValueError):
    """A request the cache cannot serve; the message names the field. `index` is its batch position."""

    def __init__(self, message: str, index: int = 0) -> None:
        super().__init__(message)
        self.index = index


def cacheable(request: generation_pb2.GenerateRequest) -> bool:
    """Greedy or seeded: the same inputs give the same answer."""
    return request.temperature == 0.0 or request.HasField("seed")


def canonical_body(raw: bytes) -> str:
    """The request body as canonical JSON (keys sorted, no whitespace), without the fields
    that only choose how the answer is delivered: field order and spacing never split an
    entry; every field that can change the answer (tools, response_format, images) does."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw.decode("utf-8", "replace")
    if isinstance(body, dict):
        for name in ("stream", "stream_options"):
            body.pop(name, None)
    return orjson.dumps(body, option=orjson.OPT_SORT_KEYS).decode()


def cache_key(tenant: str, request: generation_pb2.GenerateRequest) -> bytes | None:
    """sha256 over the inputs that fix the answer; None when the request is not cacheable."""
    if not cacheable(request):
        return None
    seed = str(request.seed) if request.HasField("seed") else "-"
    fields: tuple[str, ...] = (tenant, request.model, request.prompt, str(request.max_tokens),
                               repr(request.temperature), seed)
    if request.system:  # keys of requests without one stay what they were
        fields += (request.system,)
    for message in request.messages:  # a chat's turns (a template model reads these, not the prompt)
        fields += (message.role, message.content)
    if request.api:  # the client's whole request: tools, response formats, images, options all count
        fields += (request.api, canonical_body(request.body))
    parts: list[bytes] = []
    for text in fields:  # length-prefixed: ("ab", "c") and ("a", "bc") differ
        data = text.encode()
        parts.append(len(data).to_bytes(8, "little"))
        parts.append(data)
    return hashlib.sha256(b"".join(parts)).digest()  # one update: the same digest as one per part


class CacheService(cache_pb2_grpc.CacheServicer):
    """Response cache with TTL and LRU eviction; the index lives on `device`."""

    def __init__(
        self,
        config: CacheConfig,
        device: DeviceState,
        clock: Clock = time.monotonic,
        key_hash: KeyHash = default_key_hash,  # a test hook: force hash collisions
        pregenerated: PregeneratedAnswers | None = None,
    ) -> None:
        self.config = config
        self._clock = clock
        self._index: CacheIndex[generation_pb2.GenerateResponse] = CacheIndex(device, config.max_entries, key_hash)
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self.pregenerated = pregenerated
        self.pregenerated_hits = 0

    def stats(self) -> cache_pb2.CacheStatsResponse:
        """Counters; expired entries are dropped first so `entries` counts what can still hit."""
        with self._lock:
            self._index.remove_expired(self._clock())
            return cache_pb2.CacheStatsResponse(
                hits=self._hits, misses=self._misses, entries=len(self._index), evictions=self._evictions
            )

    # -- gRPC --------------------------------------------------------------------------
    def lookup(self, items: Sequence[LookupItem], options: CallOptions = NO_OPTIONS) -> list[Probe | ItemError]:
        """Probe every cacheable item with one index probe; a malformed item is refused alone.

        A hit is a copy of the stored answer marked `cached`; a cacheable item's probe
        carries its key, which a store may send back instead of the request."""
        probes: list[Probe | ItemError] = []
        keys: list[bytes] = []
        probing: list[int] = []
        for index, (tenant, request) in enumerate(items):
            try:
                self._check(tenant, request, index)
            except InvalidCacheRequest as error:
                probes.append(ItemError(grpc.StatusCode.INVALID_ARGUMENT, str(error)))
                continue
            assert request is not None  # `_check` refuses a missing one
            key = cache_key(tenant, request)
            if key is None:
                probes.append(NOT_CACHEABLE)  # neither a hit nor a miss
                continue
            answer = self.pregenerated.lookup(request) if self.pregenerated is not None else None
            if answer is not None:
                answer.cached = True
                probes.append(Probe(cacheable=True, key=key, hit=answer, pregenerated=True))
                with self._lock:
                    self.pregenerated_hits += 1
                continue
            probes.append(Probe(cacheable=True, key=key))
            keys.append(key)
            probing.append(index)
        if keys:
            with self._lock:
                found = self._index.lookup_batch(keys, self._clock())
                for index, key, slot in zip(probing, keys, found, strict=True):
                    if slot < 0:
                        self._misses += 1
                        continue
                    self._hits += 1
                    hit = generation_pb2.GenerateResponse()
                    hit.CopyFrom(self._index.value(slot))
                    hit.cached = True
                    probes[index] = Probe(cacheable=True, key=key, hit=hit)
        return probes

    def LookupBatch(self, request: cache_pb2.CacheLookupBatchRequest,
                    context: Any = None) -> cache_pb2.CacheLookupBatchResponse:
        """`lookup` over the wire."""
        return LOOKUP_BATCH.serve(self, request, context)

    def store(self, items: Sequence[StoreItem], options: CallOptions = NO_OPTIONS) -> list[bool | ItemError]:
        """Keep every storable answer, in order (the last one for a key wins): whether each
        was stored. Shadow traffic and non-cacheable requests are not stored; a malformed
        item is refused alone."""
        stored: list[bool | ItemError] = []
        entries: list[tuple[bytes, generation_pb2.GenerateResponse]] = []
        for index, item in enumerate(items):
            try:
                key = self._store_key(item, index)
            except InvalidCacheRequest as error:
                stored.append(ItemError(grpc.StatusCode.INVALID_ARGUMENT, str(error)))
                continue
            if item.shadow or key is None:
                stored.append(False)
                continue
            assert item.response is not None  # `_store_key` refuses a missing one
            value = generation_pb2.GenerateResponse()
            value.CopyFrom(item.response)
            entries.append((key, value))
            stored.append(True)
        if entries:
            with self._lock:
                now = self._clock()
                for key, value in entries:
                    self._evictions += self._index.put(key, value, now, self.config.ttl_s)
        return stored

    def StoreBatch(self, request: cache_pb2.CacheStoreBatchRequest,
                   context: Any = None) -> cache_pb2.CacheStoreBatchResponse:
        """`store` over the wire."""
        return STORE_BATCH.serve(self, request, context)

    def Stats(self, request: cache_pb2.CacheStatsRequest, context: Any) -> cache_pb2.CacheStatsResponse:
        return self.stats()

    # -- checks ------------------------------------------------------------------------
    @classmethod
    def _store_key(cls, item: StoreItem, index: int) -> bytes | None:
        """The key an item is stored under: the lookup's (sent back), or keyed from the request."""
        if item.response is None:
            raise InvalidCacheRequest("response: missing (nothing to store)", index)
        if item.key:
            if len(item.key) != KEY_BYTES:
                raise InvalidCacheRequest(f"key: expected the {KEY_BYTES}-byte key a lookup returned, "
                                          f"got {len(item.key)} bytes", index)
            return item.key
        cls._check(item.tenant, item.request, index)
        assert item.request is not None  # `_check` refuses a missing one
        return cache_key(item.tenant, item.request)

    @staticmethod
    def _check(tenant: str, request: generation_pb2.GenerateRequest | None, index: int) -> None:
        if not tenant:
            raise InvalidCacheRequest("tenant: must not be empty (entries are kept per tenant)", index)
        if request is None:
            raise InvalidCacheRequest("request: missing (the generate request to key on)", index)
        if not request.model:
            raise InvalidCacheRequest("request.model: must be the resolved model id, got ''", index)



def build(cache: CacheConfig, inference: InferenceConfig, device: DeviceState) -> CacheService:
    """The servicer for the `cache` section; the pre-generated table is checked against the
    models the `inference` section serves."""
    pregenerated = None
    if cache.pregenerated:
        pregenerated = PregeneratedAnswers(cache.pregenerated, served_digests(inference), cache.pregenerated_check_s)
    return CacheService(cache, device, pregenerated=pregenerated)
