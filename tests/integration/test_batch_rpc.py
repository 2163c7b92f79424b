"""A step's batch call reads the same in-process and over the wire.

In the spine a step's items go straight to the servicer's operation (`runtime.placement.in_process`);
in the layered stack they are encoded into the batch rpc, served (decoded, decided by that
same operation, encoded) and the answer decoded. For random batches (good and bad credentials, known and
unknown models, malformed and over-limit rate-limit asks, cache hits, misses and bad
items) both paths give equal results on two servicers that start equal, and the wire
path's messages are the proto contract (`serve` answers what the rpc answers).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from monolith.device import DeviceContext
from runtime.placement.in_process import in_process
from services.auth.api import AUTH, CHECK_BATCH
from services.auth.service import AuthService
from services.cache.api import LOOKUP_BATCH, STORE_BATCH, StoreItem
from services.cache.service import CacheService
from services.logs.api import APPEND_BATCH, LogEntry
from services.logs.config import LogsConfig
from services.logs.service import LogsService
from services.metrics.api import RECORD_BATCH, MetricsRecord
from services.metrics.service import MetricsConfig, MetricsService
from services.pipeline.batch_rpc import BatchRpc, ItemError
from services.pipeline.interface import CallOptions
from services.ratelimit.admission import ADMIT_BATCH, AdmitItem, AdmitVerdict
from services.ratelimit.service import RateLimitService
from services.registry import DEFAULT
from services.router.api import RESOLVE_BATCH
from services.router.service import RouterService
from tests.conftest import DEV_KEY, OTHER_KEY, TIGHT_KEY, config_for_tests, make_jwt
from wire.v1 import batch_pb2, generation_pb2, metrics_pb2

CONFIG = config_for_tests(ratelimit={"tenants": {
    "tight": {"requests_per_second": 0.5, "burst": 2, "tokens_per_minute": 600, "token_burst": 60,
              "max_concurrent_requests": 1},
    "small": {"requests_per_second": 1, "burst": 2, "tokens_per_minute": 120, "token_burst": 40},
}})
CACHED = generation_pb2.GenerateRequest(model="tiny-lm", prompt="cached", max_tokens=4)


def _pair(make: Any) -> tuple[Any, Any]:
    """Two servicers that start equal: one called in-process, one through the codec."""
    return make(), make()


def _same(local: list[Any], wire: list[Any]) -> None:
    assert len(local) == len(wire)
    for mine, theirs in zip(local, wire, strict=True):
        if isinstance(mine, ItemError) or isinstance(theirs, ItemError):
            assert mine == theirs
        elif isinstance(mine, AdmitVerdict):
            assert (mine.admitted, mine.retry_after_s, mine.over, bool(mine.lease_id)) == \
                (theirs.admitted, theirs.retry_after_s, theirs.over, bool(theirs.lease_id))
        elif hasattr(mine, "SerializeToString"):
            assert mine.SerializeToString(deterministic=True) == theirs.SerializeToString(deterministic=True)
        else:
            assert mine == theirs


def _both(rpc: BatchRpc[Any, Any], local: Any, remote: Any, items: list[Any]) -> None:
    interface = DEFAULT[_component(rpc)].interface
    assert interface is not None
    direct = getattr(in_process(interface, local), rpc.method)(list(items))
    over_wire = rpc.decode_results(getattr(remote, rpc.rpc)(rpc.encode_items(list(items)), None))
    _same(direct, over_wire)


def _component(rpc: BatchRpc[Any, Any]) -> str:
    return {"CheckBatch": "auth", "ResolveBatch": "router", "AdmitBatch": "ratelimit", "LookupBatch": "cache",
            "StoreBatch": "cache", "RecordBatch": "metrics", "AppendBatch": "logs"}[rpc.rpc]


CREDENTIALS = st.sampled_from([f"Bearer {DEV_KEY}", f"Bearer {OTHER_KEY}", TIGHT_KEY, "Bearer nope", "", "Bearer ",
                               make_jwt("other", expires_in=3600), make_jwt("dev", expires_in=-3600), "Bearer a.b.c"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(CREDENTIALS, max_size=8))
def test_auth_reads_the_same_in_process_and_over_the_wire(credentials: list[str]) -> None:
    local, remote = _pair(lambda: AuthService(CONFIG.auth, DeviceContext()))
    _both(CHECK_BATCH, local, remote, credentials)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(["tiny-lm", "", "nope", "x" * 200, "tiny-lm-mini", "default"]), max_size=6))
def test_router_reads_the_same_in_process_and_over_the_wire(names: list[str]) -> None:
    local, remote = _pair(lambda: RouterService(CONFIG.router, DeviceContext()))
    _both(RESOLVE_BATCH, local, remote, names)


ASKS = st.builds(AdmitItem, tenant=st.sampled_from(["dev", "tight", ""]), model=st.sampled_from(["tiny-lm", ""]),
                 tokens=st.sampled_from([1, 20, 59, 61, 5000]), dry_run=st.booleans(),
                 lease_ttl_s=st.sampled_from([0.0, 30.0]), busy=st.sampled_from([0.0, 0.95]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(ASKS, max_size=6), min_size=1, max_size=4))
def test_rate_limit_reads_the_same_in_process_and_over_the_wire(batches: list[list[AdmitItem]]) -> None:
    now = [1000.0]

    def make() -> RateLimitService:
        return RateLimitService(CONFIG.ratelimit, DeviceContext(), clock=lambda: now[0])

    local, remote = _pair(make)
    for batch in batches:  # the buckets and slots carry over from batch to batch
        _both(ADMIT_BATCH, local, remote, batch)
        now[0] += 0.5
    assert local.snapshot() == remote.snapshot()


def _cache() -> CacheService:
    service = CacheService(CONFIG.cache, DeviceContext())
    answer = generation_pb2.GenerateResponse(text="abcd", token_ids=[1, 2, 3, 4], model="tiny-lm", completion_tokens=4)
    service.store([StoreItem("dev", answer, request=CACHED)])
    return service


LOOKUPS = st.tuples(st.sampled_from(["dev", "other", ""]), st.sampled_from([
    CACHED, None, generation_pb2.GenerateRequest(model="tiny-lm", prompt="other", max_tokens=4),
    generation_pb2.GenerateRequest(model="", prompt="no model"),
    generation_pb2.GenerateRequest(model="tiny-lm", prompt="warm", temperature=0.7)]))


@settings(max_examples=40, deadline=None)
@given(st.lists(LOOKUPS, max_size=6))
def test_cache_lookup_reads_the_same_in_process_and_over_the_wire(items: list[Any]) -> None:
    local, remote = _pair(_cache)
    _both(LOOKUP_BATCH, local, remote, items)


def test_an_in_process_batch_call_keeps_the_wires_rules() -> None:
    """No time left is DEADLINE_EXCEEDED before the servicer runs; its exception is UNKNOWN."""
    service = AuthService(CONFIG.auth, DeviceContext())
    auth = in_process(AUTH, service)
    with pytest.raises(grpc.RpcError) as late:
        auth.check([DEV_KEY], CallOptions(timeout=0.0))
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    def broken(credentials: Any, options: Any = None) -> Any:
        raise RuntimeError("table gone")

    service.check = broken  # type: ignore[method-assign]
    with pytest.raises(grpc.RpcError) as failed:
        auth.check([DEV_KEY], CallOptions(timeout=1.0))
    assert failed.value.code() == grpc.StatusCode.UNKNOWN and "table gone" in failed.value.details()


STORES = st.builds(StoreItem, tenant=st.sampled_from(["dev", ""]),
                   response=st.sampled_from([None, generation_pb2.GenerateResponse(text="x", completion_tokens=1)]),
                   key=st.sampled_from([b"", b"k" * 32, b"short"]),
                   request=st.sampled_from([None, CACHED, generation_pb2.GenerateRequest(model="", prompt="p")]),
                   shadow=st.booleans())


@settings(max_examples=40, deadline=None)
@given(st.lists(STORES, max_size=6))
def test_cache_store_reads_the_same_in_process_and_over_the_wire(items: list[StoreItem]) -> None:
    local, remote = _pair(_cache)
    _both(STORE_BATCH, local, remote, items)
    assert local.stats() == remote.stats()


RECORDS = st.builds(MetricsRecord, layout=st.just("collapsed"), model=st.sampled_from(["tiny-lm", ""]),
                    tenant=st.sampled_from(["dev", "other"]), status=st.sampled_from(["OK", "UNAVAILABLE"]),
                    latency_s=st.sampled_from([0.004, 0.2, float("nan"), -1.0]),
                    middleware_s=st.sampled_from([{}, {"auth": 0.0001, "cache": 0.0002}, {"": 0.1}]),
                    cached=st.booleans(), shadow=st.booleans(), completion_tokens=st.integers(0, 9),
                    failed_middlewares=st.sampled_from([(), ("cache",)]), ejected_middlewares=st.just(()))


@settings(max_examples=40, deadline=None)
@given(st.lists(RECORDS, max_size=6))
def test_metrics_count_the_same_in_process_and_over_the_wire(records: list[MetricsRecord]) -> None:
    local, remote = _pair(lambda: MetricsService(MetricsConfig(), DeviceContext()))
    _both(RECORD_BATCH, local, remote, records)
    assert local.render() == remote.render()


ENTRIES = st.builds(LogEntry, request_id=st.sampled_from(["r1", "r2"]), tenant=st.just("dev"),
                    model=st.just("tiny-lm"), status=st.just("OK"),
                    latency_ms=st.sampled_from([3.5, float("inf")]), layout=st.just("collapsed"),
                    cached=st.booleans(), shadow=st.booleans(), fields=st.sampled_from([{}, {"big": "x" * 70_000}]))


def test_log_lines_are_the_same_in_process_and_over_the_wire(tmp_path: Path) -> None:
    services = [LogsService(LogsConfig.parse({"path": f"{name}.jsonl", "fsync": False}), run_dir=tmp_path,
                            clock=lambda: 1700000000.5) for name in ("local", "remote")]

    @settings(max_examples=30, deadline=None)
    @given(st.lists(ENTRIES, max_size=5))
    def check(entries: list[LogEntry]) -> None:
        _both(APPEND_BATCH, services[0], services[1], entries)

    check()
    for service in services:
        service.close()
    assert (tmp_path / "local.jsonl").read_bytes() == (tmp_path / "remote.jsonl").read_bytes()
    assert (tmp_path / "local.jsonl").read_bytes().count(b"\n") > 0


def test_an_in_process_answer_after_the_deadline_is_deadline_exceeded() -> None:
    """As on the wire: a component that answers too late has not answered (the runner then
    stops a fail-closed step's requests with UNAVAILABLE, naming the budget)."""
    service = AuthService(CONFIG.auth, DeviceContext())
    auth = in_process(AUTH, service)
    check = service.check

    def slow(credentials: Any, options: Any = None) -> Any:
        time.sleep(0.05)
        return check(credentials)

    service.check = slow  # type: ignore[method-assign]
    with pytest.raises(grpc.RpcError) as late:
        auth.check([DEV_KEY], CallOptions(timeout=0.01))
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert auth.check([DEV_KEY], CallOptions(timeout=5.0))[0].principal.tenant == "dev"


def test_a_status_code_grpc_does_not_define_fails_that_item_alone() -> None:
    answer = metrics_pb2.RecordBatchResponse(results=[batch_pb2.ItemStatus(code=99, message="odd peer"),
                                                      batch_pb2.ItemStatus()])
    assert RECORD_BATCH.decode_results(answer) == [ItemError(grpc.StatusCode.UNKNOWN, "odd peer"), None]


LONE = st.builds(AdmitItem, tenant=st.sampled_from(["dev", "small", "tight", ""]),
                 model=st.sampled_from(["tiny-lm", "tiny-lm-mini"]), tokens=st.sampled_from([0, 1, 20, 39, 41, 5000]),
                 dry_run=st.booleans(), lease_ttl_s=st.just(30.0), busy=st.just(0.0))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.lists(LONE, min_size=1, max_size=6), st.sampled_from([0.0, 0.05, 0.5, 3.0]),
                          st.sampled_from([None, 0.5, 1.0])), min_size=1, max_size=25))
def test_the_item_by_item_short_path_answers_as_the_general_path(steps: list[tuple[list[AdmitItem], float, Any]]) -> None:
    """`admit` decides items straight on their buckets, one by one, while it can (and
    the rest through the general path); the answers and the bucket levels are the general
    path's, batch by batch, shares changing."""
    now = [1000.0]

    def make(short: bool) -> RateLimitService:
        service = RateLimitService(CONFIG.ratelimit, DeviceContext(),
                                   clock=lambda: now[0])
        service.alone_fast_path = short
        return service

    short, general = make(True), make(False)
    for items, wait, share in steps:
        if share is not None:
            short.set_share(share)
            general.set_share(share)
        _same(short.admit(items), general.admit(items))
        assert short.snapshot() == general.snapshot()
        now[0] += wait
