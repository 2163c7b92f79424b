"""The Cache service: answers for deterministic requests, kept per tenant for a while.

Only a request whose answer is fixed by its inputs is cacheable: greedy decoding
(temperature 0) or a set seed. The key is sha256 over (tenant, resolved model, prompt,
max_tokens, temperature, seed), so tenants never see each other's entries and a different
parameter is a different entry. Priority and timeouts change when an answer comes, not
what it is, so they are not part of the key.

`lookup_many` probes a whole micro-batch in one tensor op (see `services/cache_index.py`);
the gRPC `Lookup` is the batch of one. `lookup_keys` and `store_key` are the same without
the protos around them: the spine keys a request once (`key_for`) and probes and stores
by that key. Shadow stores are refused so that shadow traffic
can never change what clients are served.
"""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Any

import grpc

from services.cache_index import CacheIndex, KeyHash, default_key_hash
from services.common import Clock, DeviceState, ReadHooks
from services.sections import CacheConfig
from spine.v1 import cache_pb2, cache_pb2_grpc, generation_pb2


class InvalidCacheRequest(ValueError):
    """A request the cache cannot serve; the message names the field. `index` is its batch position."""

    def __init__(self, message: str, index: int = 0) -> None:
        super().__init__(message)
        self.index = index


def cacheable(request: generation_pb2.GenerateRequest) -> bool:
    """Greedy or seeded: the same inputs give the same answer."""
    return request.temperature == 0.0 or request.HasField("seed")


def cache_key(tenant: str, request: generation_pb2.GenerateRequest) -> bytes | None:
    """sha256 over the inputs that fix the answer; None when the request is not cacheable."""
    if not cacheable(request):
        return None
    seed = str(request.seed) if request.HasField("seed") else "-"
    fields = (tenant, request.model, request.prompt, str(request.max_tokens), repr(request.temperature), seed)
    digest = hashlib.sha256()
    for text in fields:  # length-prefixed: ("ab", "c") and ("a", "bc") differ
        data = text.encode()
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.digest()


class CacheService(cache_pb2_grpc.CacheServicer):
    """Response cache with TTL and LRU eviction; the index lives on `device`."""

    def __init__(
        self,
        config: CacheConfig,
        device: DeviceState,
        clock: Clock = time.monotonic,
        key_hash: KeyHash = default_key_hash,  # a test hook: force hash collisions
    ) -> None:
        self.config = config
        self._clock = clock
        self._index: CacheIndex[generation_pb2.GenerateResponse] = CacheIndex(device, config.max_entries, key_hash)
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        # Run as hook(keys) before every lookup and hook(None) before `stats`: responses
        # handed over but not yet stored (the spine's completions) go in first, so a
        # repeated request still hits.
        self.read_hooks = ReadHooks()

    # -- plain Python API (the spine's batcher calls this) ----------------------------
    def lookup_many(self, requests: list[cache_pb2.CacheLookupRequest]) -> list[cache_pb2.CacheLookupResponse]:
        """Answer a micro-batch with one probe; raises InvalidCacheRequest before counting anything."""
        keys = [cache_key(r.tenant, r.request) for r in self._checked(requests)]
        responses = []
        for key, answer in zip(keys, self.lookup_keys(keys), strict=True):
            if key is None:
                responses.append(cache_pb2.CacheLookupResponse(hit=False, cacheable=False))
            elif answer is None:
                responses.append(cache_pb2.CacheLookupResponse(hit=False, cacheable=True))
            else:
                responses.append(cache_pb2.CacheLookupResponse(hit=True, cacheable=True, response=answer))
        return responses

    def lookup_keys(self, keys: list[bytes | None]) -> list[generation_pb2.GenerateResponse | None]:
        """`lookup_many` by keys (`key_for`'s), without protos around them: the spine's path.
        A None key (not cacheable) is neither a hit nor a miss; a hit is a copy marked cached."""
        probe = [k for k in keys if k is not None]
        self.read_hooks.run(probe)
        answers: list[generation_pb2.GenerateResponse | None] = []
        with self._lock:
            slots = iter(self._index.lookup_batch(probe, self._clock()) if probe else [])
            for key in keys:
                if key is None:
                    answers.append(None)
                    continue
                slot = next(slots)
                if slot < 0:
                    self._misses += 1
                    answers.append(None)
                    continue
                self._hits += 1
                answer = generation_pb2.GenerateResponse()
                answer.CopyFrom(self._index.value(slot))
                answer.cached = True
                answers.append(answer)
        return answers

    def store(self, request: cache_pb2.CacheStoreRequest) -> bool:
        """Keep a response; False for shadow traffic and non-cacheable requests."""
        self._checked([request])
        if not request.HasField("response"):
            raise InvalidCacheRequest("response: missing (nothing to store)")
        key = cache_key(request.tenant, request.request)
        if request.shadow or key is None:
            return False
        self.store_key(key, request.response)
        return True

    def store_key(self, key: bytes, response: generation_pb2.GenerateResponse) -> None:
        """`store` by key (`key_for`'s): the spine's path, which keyed the request at lookup."""
        value = generation_pb2.GenerateResponse()
        value.CopyFrom(response)
        with self._lock:
            self._evictions += self._index.put(key, value, self._clock(), self.config.ttl_s)

    @classmethod
    def key_for(cls, tenant: str, request: generation_pb2.GenerateRequest) -> bytes | None:
        """The key `lookup_many` and `store` would use (None: not cacheable); raises
        InvalidCacheRequest for what they would refuse."""
        cls._check(tenant, request, 0)
        return cache_key(tenant, request)

    def stats(self) -> cache_pb2.CacheStatsResponse:
        """Counters; expired entries are dropped first so `entries` counts what can still hit."""
        self.read_hooks.run(None)
        with self._lock:
            self._index.remove_expired(self._clock())
            return cache_pb2.CacheStatsResponse(
                hits=self._hits, misses=self._misses, entries=len(self._index), evictions=self._evictions
            )

    # -- gRPC --------------------------------------------------------------------------
    def Lookup(self, request: cache_pb2.CacheLookupRequest, context: Any) -> cache_pb2.CacheLookupResponse:
        try:
            return self.lookup_many([request])[0]
        except InvalidCacheRequest as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        raise AssertionError("context.abort returned")  # pragma: no cover

    def Store(self, request: cache_pb2.CacheStoreRequest, context: Any) -> cache_pb2.CacheStoreResponse:
        try:
            return cache_pb2.CacheStoreResponse(stored=self.store(request))
        except InvalidCacheRequest as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        raise AssertionError("context.abort returned")  # pragma: no cover

    def Stats(self, request: cache_pb2.CacheStatsRequest, context: Any) -> cache_pb2.CacheStatsResponse:
        return self.stats()

    # -- checks ------------------------------------------------------------------------
    @classmethod
    def _checked(cls, requests: list[Any]) -> list[Any]:
        for index, r in enumerate(requests):
            cls._check(r.tenant, r.request if r.HasField("request") else None, index)
        return requests

    @staticmethod
    def _check(tenant: str, request: generation_pb2.GenerateRequest | None, index: int) -> None:
        if not tenant:
            raise InvalidCacheRequest("tenant: must not be empty (entries are kept per tenant)", index)
        if request is None:
            raise InvalidCacheRequest("request: missing (the generate request to key on)", index)
        if not request.model:
            raise InvalidCacheRequest("request.model: must be the resolved model id, got ''", index)
