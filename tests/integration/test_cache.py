"""The Cache service: deterministic answers per tenant, TTL, LRU, batched probes."""

from __future__ import annotations

import tempfile
from collections import OrderedDict
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from monolith.device import DeviceContext
from services.cache.index import CacheIndex
from services.cache.service import CacheConfig, CacheService, cache_key
from services.common import ConfigError
from services.pipeline.local_context import LocalContext
from tests.batch_of_one import one
from wire.v1 import cache_pb2, cache_pb2_grpc
from wire.v1.generation_pb2 import GenerateRequest, GenerateResponse


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(max_entries: int = 8, ttl_s: float = 60.0, **kwargs) -> tuple[CacheService, FakeClock]:
    clock = FakeClock()
    config = CacheConfig.parse({"max_entries": max_entries, "ttl_s": ttl_s})
    return CacheService(config, DeviceContext(), clock=clock, **kwargs), clock


def gen(prompt: str = "hello", **fields) -> GenerateRequest:
    params = {"model": "tiny-lm", "prompt": prompt, "max_tokens": 8, "temperature": 0.0, **fields}
    return GenerateRequest(**params)


def answer(text: str) -> GenerateResponse:
    return GenerateResponse(text=text, token_ids=[1, 2, 3], model="tiny-lm", finish_reason="length")


def store(service: CacheService, request: GenerateRequest, text: str, tenant: str = "dev", shadow: bool = False) -> bool:
    item = cache_pb2.CacheStoreRequest(tenant=tenant, request=request, response=answer(text), shadow=shadow)
    return bool(one(service.StoreBatch(cache_pb2.CacheStoreBatchRequest(items=[item]))).stored)


def lookup(service: CacheService, request: GenerateRequest, tenant: str = "dev") -> cache_pb2.CacheLookupResponse:
    return one(service.LookupBatch(cache_pb2.CacheLookupBatchRequest(
        items=[cache_pb2.CacheLookupRequest(tenant=tenant, request=request)])))


def stats(service: CacheService) -> tuple[int, int, int, int]:
    s = service.Stats(cache_pb2.CacheStatsRequest(), LocalContext())
    return s.hits, s.misses, s.entries, s.evictions


# -- config --------------------------------------------------------------------------------


def test_default_config_parses() -> None:
    config_path = Path(__file__).resolve().parents[2] / "runtime" / "default_config.yaml"
    config = CacheConfig.parse(yaml.safe_load(config_path.read_text())["cache"])
    assert (config.max_entries, config.ttl_s) == (4096, 300.0)


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"max_entries": 0}, "cache.max_entries"),
        ({"max_entries": 2.5}, "cache.max_entries"),
        ({"ttl_s": -1}, "cache.ttl_s"),
        ({"ttl_s": 0}, "cache.ttl_s"),
        ({"ttl": 5}, "cache.ttl"),
    ],
)
def test_bad_config_raises_config_error_naming_the_field(section: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        CacheConfig.parse(section)


# -- hits and misses -------------------------------------------------------------------------


def test_a_stored_answer_comes_back_marked_cached() -> None:
    service, _ = make()
    assert lookup(service, gen()).hit is False
    assert store(service, gen(), "world") is True
    found = lookup(service, gen())
    assert found.hit and found.cacheable
    assert found.response.text == "world"
    assert list(found.response.token_ids) == [1, 2, 3]
    assert found.response.cached is True


@pytest.mark.parametrize(
    "other",
    [
        gen("hello!"),
        gen(model="other-lm"),
        gen(max_tokens=9),
        gen(temperature=0.5, seed=7),
        gen(seed=7),
    ],
    ids=["prompt", "model", "max_tokens", "temperature", "seed"],
)
def test_a_different_parameter_is_a_miss(other: GenerateRequest) -> None:
    service, _ = make()
    store(service, gen(), "world")
    assert lookup(service, other).hit is False


def test_tenants_never_see_each_others_entries() -> None:
    service, _ = make()
    store(service, gen(), "for dev", tenant="dev")
    assert lookup(service, gen(), tenant="other").hit is False
    store(service, gen(), "for other", tenant="other")
    assert lookup(service, gen(), tenant="dev").response.text == "for dev"
    assert lookup(service, gen(), tenant="other").response.text == "for other"


def test_seeded_sampling_is_cacheable() -> None:
    service, _ = make()
    assert store(service, gen(temperature=0.8, seed=42), "seeded") is True
    assert lookup(service, gen(temperature=0.8, seed=42)).response.text == "seeded"


def test_storing_the_same_key_again_replaces_the_answer() -> None:
    service, _ = make()
    store(service, gen(), "first")
    store(service, gen(), "second")
    assert lookup(service, gen()).response.text == "second"
    assert stats(service)[2] == 1


# -- non-cacheable and shadow ------------------------------------------------------------------


def test_sampled_request_without_seed_is_not_cacheable_and_not_counted() -> None:
    service, _ = make()
    sampled = gen(temperature=0.7)
    assert cache_key("dev", sampled) is None
    assert store(service, sampled, "random") is False
    reply = lookup(service, sampled)
    assert (reply.hit, reply.cacheable) == (False, False)
    assert stats(service) == (0, 0, 0, 0)


def test_shadow_stores_are_refused() -> None:
    service, _ = make()
    assert store(service, gen(), "shadow answer", shadow=True) is False
    assert lookup(service, gen()).hit is False


# -- ttl, lru, stats -----------------------------------------------------------------------------


def test_entries_expire_after_the_ttl() -> None:
    service, clock = make(ttl_s=10.0)
    store(service, gen(), "world")
    clock.now += 9.9
    assert lookup(service, gen()).hit is True
    clock.now += 0.1
    assert lookup(service, gen()).hit is False
    assert stats(service)[2] == 0


def test_lru_evicts_the_least_recently_used_at_max_entries() -> None:
    service, _ = make(max_entries=3)
    for name in ("a", "b", "c"):
        store(service, gen(name), name)
    assert lookup(service, gen("a")).hit  # a is now the most recent; b the least
    store(service, gen("d"), "d")
    assert [lookup(service, gen(n)).hit for n in ("a", "b", "c", "d")] == [True, False, True, True]
    store(service, gen("e"), "e")  # the lookups above touched a, c, d in that order: a goes
    assert [lookup(service, gen(n)).hit for n in ("a", "c", "d", "e")] == [False, True, True, True]
    assert stats(service)[2:] == (3, 2)


def test_expired_entries_make_room_before_anything_is_evicted() -> None:
    service, clock = make(max_entries=2, ttl_s=10.0)
    store(service, gen("old"), "old")
    clock.now += 5
    store(service, gen("young"), "young")
    clock.now += 6  # old has expired, young has not
    store(service, gen("new"), "new")
    assert lookup(service, gen("young")).hit and lookup(service, gen("new")).hit
    assert stats(service)[3] == 0


def test_stats_count_hits_misses_entries_and_evictions() -> None:
    service, _ = make(max_entries=2)
    lookup(service, gen("a"))
    store(service, gen("a"), "a")
    lookup(service, gen("a"))
    lookup(service, gen("a"))
    store(service, gen("b"), "b")
    store(service, gen("c"), "c")
    lookup(service, gen(temperature=1.0))
    assert stats(service) == (2, 1, 2, 1)


# -- batched probes and the index -------------------------------------------------------------


def test_batched_lookup_equals_one_by_one() -> None:
    one_by_one, _ = make(max_entries=16)
    batched, _ = make(max_entries=16)
    for service in (one_by_one, batched):
        for i in range(0, 20, 2):
            store(service, gen(f"p{i}"), f"a{i}")
    requests = [cache_pb2.CacheLookupRequest(tenant="dev", request=gen(f"p{i}")) for i in range(20)]
    requests += [
        cache_pb2.CacheLookupRequest(tenant="dev", request=gen("p4")),  # the same key twice
        cache_pb2.CacheLookupRequest(tenant="dev", request=gen("p4", temperature=0.3)),
        cache_pb2.CacheLookupRequest(tenant="x", request=gen("p2")),
    ]
    expected = [one(one_by_one.LookupBatch(cache_pb2.CacheLookupBatchRequest(items=[r]))) for r in requests]
    answer = batched.LookupBatch(cache_pb2.CacheLookupBatchRequest(items=requests))
    assert [result.response for result in answer.results] == expected
    assert not any(result.status.code for result in answer.results)
    assert stats(batched) == stats(one_by_one)


def test_a_malformed_item_of_a_batch_is_refused_alone() -> None:
    service, _ = make(max_entries=4)
    store(service, gen("a"), "a")
    answer = service.LookupBatch(cache_pb2.CacheLookupBatchRequest(items=[
        cache_pb2.CacheLookupRequest(tenant="", request=gen("a")),
        cache_pb2.CacheLookupRequest(tenant="dev", request=gen("a")),
    ]))
    bad, good = answer.results
    assert grpc.StatusCode.INVALID_ARGUMENT.value[0] == bad.status.code and "tenant" in bad.status.message
    assert good.status.code == 0 and good.response.hit and good.response.response.text == "a"


def test_a_store_may_send_back_the_lookups_key_instead_of_the_request() -> None:
    service, _ = make(max_entries=4)
    key = lookup(service, gen("k")).key
    assert len(key) == 32
    answer = service.StoreBatch(cache_pb2.CacheStoreBatchRequest(items=[
        cache_pb2.CacheStoreRequest(tenant="dev", key=key, response=GenerateResponse(text="by key", model="m")),
        cache_pb2.CacheStoreRequest(tenant="dev", key=b"short", response=GenerateResponse(text="x", model="m")),
    ]))
    assert [r.status.code for r in answer.results] == [0, grpc.StatusCode.INVALID_ARGUMENT.value[0]]
    assert lookup(service, gen("k")).response.text == "by key"


def test_hash_collisions_are_told_apart_by_the_full_key() -> None:
    service, _ = make(max_entries=4, key_hash=lambda key: 42)  # every key on the same 64-bit hash
    for name in ("a", "b", "c"):
        store(service, gen(name), name)
    assert [lookup(service, gen(n)).response.text for n in ("a", "b", "c")] == ["a", "b", "c"]
    assert lookup(service, gen("d")).hit is False


def test_index_probes_a_batch_and_frees_slots_for_reuse() -> None:
    index: CacheIndex[str] = CacheIndex(DeviceContext(), max_entries=4, key_hash=lambda key: key[0])
    keys = [bytes([7, i]) for i in range(4)]  # one home position: a probe chain of four
    for i, key in enumerate(keys):
        index.put(key, f"v{i}", now=0.0, ttl_s=10.0)
    slots = index.lookup_batch([*keys, bytes([7, 9])], now=1.0)
    assert [index.value(s) for s in slots[:4]] == ["v0", "v1", "v2", "v3"]
    assert slots[4] == -1
    assert index.remove_expired(now=10.0) == 4
    assert len(index) == 0
    index.put(keys[3], "again", now=20.0, ttl_s=10.0)
    assert index.value(index.lookup_batch([keys[3]], now=21.0)[0]) == "again"


class ReferenceLru:
    """The cache's contract in a dozen lines: an ordered dict with expiry times."""

    def __init__(self, max_entries: int, ttl_s: float) -> None:
        self.entries: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()
        self.max_entries, self.ttl_s = max_entries, ttl_s
        self.hits = self.misses = self.evictions = 0

    def lookup(self, key: tuple[str, str], now: float) -> str | None:
        found = self.entries.get(key)
        if found is None or found[1] <= now:
            self.misses += 1
            return None
        self.hits += 1
        self.entries.move_to_end(key)
        return found[0]

    def store(self, key: tuple[str, str], text: str, now: float) -> None:
        if key not in self.entries and len(self.entries) >= self.max_entries:
            self.expire(now)
            if len(self.entries) >= self.max_entries:
                self.entries.popitem(last=False)
                self.evictions += 1
        self.entries[key] = (text, now + self.ttl_s)
        self.entries.move_to_end(key)

    def expire(self, now: float) -> None:
        for key in [k for k, (_, expiry) in self.entries.items() if expiry <= now]:
            del self.entries[key]


operations = st.lists(
    st.tuples(
        st.sampled_from(["store", "store", "lookup", "lookup", "lookup", "wait", "stats"]),
        st.sampled_from(["dev", "dev", "other"]),
        st.sampled_from("abcde"),
        st.sampled_from([0.5, 1.0, 6.0]),
    ),
    min_size=10,
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(operations, st.integers(1, 5))
def test_cache_behaves_like_a_reference_lru_with_ttl_even_when_hashes_collide(ops: list, max_entries: int) -> None:
    service, clock = make(max_entries=max_entries, ttl_s=5.0, key_hash=lambda key: key[0] % 3)
    reference = ReferenceLru(max_entries, 5.0)
    for step, (op, tenant, prompt, wait) in enumerate(ops):
        if op == "store":
            store(service, gen(prompt), f"{prompt}{step}", tenant=tenant)
            reference.store((tenant, prompt), f"{prompt}{step}", clock.now)
        elif op == "lookup":
            found = lookup(service, gen(prompt), tenant=tenant)
            expected = reference.lookup((tenant, prompt), clock.now)
            assert (found.response.text if found.hit else None) == expected
        elif op == "wait":
            clock.now += wait
        else:
            reference.expire(clock.now)
            assert stats(service) == (reference.hits, reference.misses, len(reference.entries), reference.evictions)


def test_index_finds_displaced_entries_after_the_one_at_home_expires() -> None:
    index: CacheIndex[str] = CacheIndex(DeviceContext(), max_entries=4, key_hash=lambda key: 5)
    index.put(b"first", "first", now=0.0, ttl_s=10.0)  # at home
    index.put(b"second", "second", now=5.0, ttl_s=10.0)  # one past home
    index.put(b"third", "third", now=5.0, ttl_s=10.0)  # two past home
    assert index.remove_expired(now=11.0) == 1
    slots = index.lookup_batch([b"first", b"second", b"third"], now=12.0)
    assert slots[0] == -1
    assert [index.value(s) for s in slots[1:]] == ["second", "third"]


def test_index_memory_is_accounted_to_the_cache() -> None:
    device = DeviceContext()
    CacheIndex(device, max_entries=100)
    assert device.usage()["cache"] == 256 * (2 * 8 + 8)  # 256 positions: hash + tick + expiry


# -- bad input and the wire -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("req", "field"),
    [
        (cache_pb2.CacheLookupRequest(tenant="", request=gen()), "tenant"),
        (cache_pb2.CacheLookupRequest(tenant="dev"), "request"),
        (cache_pb2.CacheLookupRequest(tenant="dev", request=gen(model="")), "request.model"),
    ],
)
def test_bad_lookups_are_invalid_argument_naming_the_field(req: cache_pb2.CacheLookupRequest, field: str) -> None:
    service, _ = make()
    with pytest.raises(grpc.RpcError) as error:
        one(service.LookupBatch(cache_pb2.CacheLookupBatchRequest(items=[req])))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith(field + ":")


def test_a_store_without_a_response_is_invalid_argument() -> None:
    service, _ = make()
    with pytest.raises(grpc.RpcError) as error:
        one(service.StoreBatch(cache_pb2.CacheStoreBatchRequest(items=[cache_pb2.CacheStoreRequest(tenant="dev",
                                                                                                   request=gen())])))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith("response:")


@pytest.fixture
def unix_address() -> Iterator[str]:
    service, _ = make()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    cache_pb2_grpc.add_CacheServicer_to_server(service, server)
    with tempfile.TemporaryDirectory(prefix="cache") as tmp:
        address = f"unix:{tmp}/cache.sock"
        server.add_insecure_port(address)
        server.start()
        try:
            yield address
        finally:
            server.stop(grace=None)


def test_round_trip_over_a_real_grpc_server_on_a_unix_socket(unix_address: str) -> None:
    with grpc.insecure_channel(unix_address) as channel:
        stub = cache_pb2_grpc.CacheStub(channel)

        def lookup_over(item: cache_pb2.CacheLookupRequest) -> cache_pb2.CacheLookupResponse:
            return one(stub.LookupBatch(cache_pb2.CacheLookupBatchRequest(items=[item]), timeout=10))

        assert not lookup_over(cache_pb2.CacheLookupRequest(tenant="dev", request=gen())).hit
        stored = one(stub.StoreBatch(cache_pb2.CacheStoreBatchRequest(items=[cache_pb2.CacheStoreRequest(
            tenant="dev", request=gen(), response=answer("hi"))]), timeout=10))
        assert stored.stored
        found = lookup_over(cache_pb2.CacheLookupRequest(tenant="dev", request=gen()))
        assert (found.hit, found.response.text, found.response.cached) == (True, "hi", True)
        counters = stub.Stats(cache_pb2.CacheStatsRequest(), timeout=10)
        assert (counters.hits, counters.misses, counters.entries) == (1, 1, 1)
        with pytest.raises(grpc.RpcError) as error:
            lookup_over(cache_pb2.CacheLookupRequest(tenant="dev"))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_the_host_dict_and_the_tensor_ops_read_the_index_identically() -> None:
    """On the CPU the index finds keys through a dict of slots; on CUDA through torch ops over
    the columns. Both must find, miss, expire and evict exactly alike (the torch path is forced
    here), hash collisions included (7 hashes for 40 keys)."""
    import random

    from services.cache.index import CacheIndex

    views: CacheIndex[int] = CacheIndex(DeviceContext(), max_entries=16, key_hash=lambda k: k[0] % 7)
    tensors: CacheIndex[int] = CacheIndex(DeviceContext(), max_entries=16, key_hash=lambda k: k[0] % 7)
    tensors._host = False  # the path CUDA takes
    rng = random.Random(5)
    now = 0.0
    for step in range(400):
        now += rng.random()
        key = bytes([rng.randrange(40)]) + b"-key"
        if rng.random() < 0.5:
            ttl = rng.choice([1.0, 5.0, 50.0])
            evicted = tensors.put(key, step, now, ttl)
            assert views.put(key, step, now, ttl) == evicted, step
        batch = [bytes([rng.randrange(40)]) + b"-key" for _ in range(rng.randrange(1, 6))]
        found = tensors.lookup_batch(batch, now)
        assert views.lookup_batch(batch, now) == found, step
