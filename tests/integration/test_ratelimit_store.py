"""Limits held across replicas by leases from a shared Redis store (`ratelimit.store`).

Every test runs a real `redis-server` on a free loopback port (`spine.tools.local_redis`)
and several rate limiters (replicas) against it, each deciding in its own process or in
this one, with its own lease thread. Traffic is paced at ten times the limit; the bounds
asserted are the ones `services.ratelimit.leases` states (admitted <= the limit plus the
replicas' reserves; at least the limit less one renewal of refill, with room for a slow
host).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from monolith.device import DeviceContext
from services.common import ConfigError
from services.ratelimit.admission import AdmitItem
from services.ratelimit.api import ReleaseItem
from services.ratelimit.service import RateLimitConfig, RateLimitService
from spine.tools.local_redis import CuttableLink, LocalRedis
from tests.waiting import eventually

RATE, BURST = 50.0, 50.0
RESERVE = 0.05
RENEW_S, LEASE_S, SLOT_TTL_S = 0.1, 0.5, 1.0
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[LocalRedis]:
    with LocalRedis(tmp_path / "redis") as server:
        yield server


def section(address: str, prefix: str, **store: Any) -> dict[str, Any]:
    return {"tenants": {"t": {"requests_per_second": RATE, "burst": BURST},
                        "c": {"max_concurrent_requests": 2}},
            "store": {"redis": {"address": address, "key_prefix": prefix, "timeout_s": 0.1},
                      "renew_interval_s": RENEW_S, "lease_s": LEASE_S, "slot_ttl_s": SLOT_TTL_S,
                      "reserve": RESERVE, **store}}


@pytest.fixture
def replicas(redis_server: LocalRedis) -> Iterator[Any]:
    made: list[RateLimitService] = []

    def make(count: int, **store: Any) -> list[RateLimitService]:
        config = RateLimitConfig.parse(section(redis_server.address, f"t{uuid.uuid4().hex[:8]}:", **store))
        made.extend(RateLimitService(config, DeviceContext()) for _ in range(count))
        return made[-count:]

    yield make
    for service in made:
        service.close()


def drive(services: list[RateLimitService], seconds: float, rate: float = 10 * RATE,
          route: Any = None) -> list[int]:
    """Send `rate` requests a second of tenant t for `seconds`, request n to
    `route(n)` (default: round robin); admitted per replica."""
    admitted = [0] * len(services)
    start, sent = time.monotonic(), 0
    while (elapsed := time.monotonic() - start) < seconds:
        while sent < int(elapsed * rate):
            i = route(sent) if route else sent % len(services)
            admitted[i] += services[i].admit([AdmitItem("t", "m", 10)])[0].admitted
            sent += 1
        time.sleep(0.002)
    return admitted


def renewed(service: RateLimitService, times: int) -> None:
    """Wait until `service` has asked the store `times` more times (each renewal asks once)."""
    assert service.store is not None
    asked = service.store.store.calls
    eventually(lambda: service.store is not None and service.store.store.calls >= asked + times,
               timeout=5.0 + times * RENEW_S, what=f"{times} renewals")


def limit(seconds: float) -> float:
    return BURST + RATE * seconds


# -- exactness ------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [2, 3])
@pytest.mark.parametrize("skewed", [True, False], ids=["all-on-one", "even"])
def test_replicas_sharing_a_store_admit_the_limit_in_total_however_traffic_is_spread(
        replicas: Any, count: int, skewed: bool) -> None:
    services = replicas(count)
    seconds = 2.0
    admitted = drive(services, seconds, route=(lambda n: 0) if skewed else None)
    total = sum(admitted)
    # Never more than the limit plus every replica's reserve; at most one renewal's refill
    # short (still in the store when the window closes), with room for a slow host.
    assert total <= limit(seconds) + count * RESERVE * BURST + 1
    assert total >= 0.85 * (limit(seconds) - RATE * RENEW_S), admitted
    if skewed:
        assert admitted[1:] == [0] * (count - 1)


def test_requests_admitted_while_the_store_is_asked_are_never_admitted_twice(
        redis_server: LocalRedis, replicas: Any) -> None:
    """A renewal asks the store without the limiter's lock, so requests go on being decided
    meanwhile; what its answer does (a grant, or paying the store's debt) must start from what
    the bucket holds then. Here, as through the gateway, every admitted request is released
    with what it used (its prompt and one generated token: one more than it was charged),
    every exchange admits a request on its replica while the store is asked, and three
    replicas share the traffic round robin, so the store's bucket keeps going a little below
    zero (spent reserves). Once, a replica that had read it in debt credited the request
    admitted during the call back to itself at its next renewal: a token nobody granted, each
    renewal, charged to the store as more debt, and its tenant ran at several times its limit,
    then starved."""
    services = replicas(3)
    during = [0]
    asking = [False]

    def admit(service: RateLimitService) -> bool:
        admitted = service.admit([AdmitItem("t", "m", 10)])[0].admitted
        if admitted:
            service.release([ReleaseItem(tenant="t", model="m", tokens_charged=10, tokens_used=11)])
        return admitted

    for service in services:
        assert service.store is not None
        exchange = service.store.store.exchange

        def exchanging(*args: Any, service: RateLimitService = service, exchange: Any = exchange) -> Any:
            if asking[0]:
                during[0] += admit(service)
            return exchange(*args)

        service.store.store.exchange = exchanging  # type: ignore[method-assign]
    seconds = 2.0
    admitted = [0] * 3
    asking[0] = True
    try:
        start, sent = time.monotonic(), 0
        while (elapsed := time.monotonic() - start) < seconds:
            while sent < int(elapsed * 10 * RATE):
                admitted[sent % 3] += admit(services[sent % 3])
                sent += 1
            time.sleep(0.002)
    finally:
        asking[0] = False
    total = sum(admitted) + during[0]
    assert total <= limit(seconds) + 3 * RESERVE * BURST + 1, (admitted, during)
    assert total >= 0.85 * (limit(seconds) - RATE * RENEW_S), (admitted, during)
    # Idle, every replica gives back what it was granted (its counts and its level agree).
    eventually(lambda: all(s.store is not None and s.store.outstanding()[0].get("requests", 0.0) == 0.0
                           for s in services), timeout=LEASE_S + 5.0, what="every lease given back",
               seen=lambda: [s.store.outstanding() for s in services if s.store is not None])
    # And no debt is left behind: the store's bucket is back full within its refill.
    store = redis.Redis(host="127.0.0.1", port=redis_server.port)
    prefix = services[0].config.store.redis.key_prefix  # type: ignore[union-attr]

    def store_level() -> float:
        seconds_now, micros = store.time()
        values = [store.hmget(key, "level", "last") for key in store.scan_iter(match=f"{prefix}b:tenant=t,*requests")]
        return min((min(BURST, float(level) + RATE * (seconds_now + micros / 1e6 - float(last)))
                    for level, last in values if level is not None), default=BURST)

    try:
        eventually(lambda: store_level() >= BURST - 1e-6, timeout=3 * BURST / RATE + 2.0,
                   what="the store's bucket full again", seen=store_level)
    finally:
        store.close()


def test_without_a_store_each_replica_holds_its_whole_limit(replicas: Any) -> None:
    """What the store is for: three store-less limiters admit three limits."""
    config = RateLimitConfig.parse({"tenants": {"t": {"requests_per_second": RATE, "burst": BURST}}})
    services = [RateLimitService(config, DeviceContext()) for _ in range(3)]
    assert sum(drive(services, 1.0)) > 2 * limit(1.0)


def test_store_calls_are_per_renewal_not_per_request(replicas: Any) -> None:
    [service] = replicas(1)
    drive([service], 1.0)
    assert service.store is not None
    assert service.store.store.calls <= 1.0 / RENEW_S + 5  # 500 decisions, about ten round trips


def test_the_tokens_an_idle_replica_holds_come_back_within_a_lease(replicas: Any) -> None:
    first, second = replicas(2)
    key = (("tenant", "t"), ("model", "m"), ("resource", "requests"))
    drive([first, second], 1.0, rate=0.6 * RATE, route=lambda n: 0)  # below the limit: it holds a lease
    assert first.bucket(key).level > 2 * RESERVE * BURST  # type: ignore[union-attr]
    assert first.store is not None and first.store.outstanding()[0]["requests"] > RESERVE * BURST
    # Idle for a lease: it gives it back, keeping the reserve.
    eventually(lambda: first.bucket(key).level <= RESERVE * BURST + 1e-9,  # type: ignore[union-attr]
               timeout=LEASE_S + 5.0, what="the lease given back")
    assert first.store.outstanding()[0]["requests"] == 0.0  # nothing leased outstanding any more
    admitted = drive([first, second], 1.0, route=lambda n: 1)
    assert admitted[1] >= 0.8 * RATE * 1.0  # the refill of the whole limit, not a share of it


# -- faults ---------------------------------------------------------------------------------


def test_store_stopped_falls_back_to_shares_logged_once_and_counted(
        redis_server: LocalRedis, replicas: Any, caplog: pytest.LogCaptureFixture) -> None:
    services = replicas(3)
    drive(services, 0.3)
    eventually(lambda: all(s.store and s.store.replicas == 3 for s in services))
    caplog.set_level(logging.WARNING, "spine.ratelimit")
    redis_server.stop()
    eventually(lambda: all(s.store and not s.store.leasing for s in services))
    renewed(services[0], 3)  # more failed renewals: still one line each
    seconds = 1.0
    admitted = drive(services, seconds)
    # Each replica decides on a third of the limit: together within the limit (plus what
    # the buckets held when the store went).
    assert sum(admitted) <= limit(seconds) + 3 * BURST / 3 + 1
    assert all(a > 0 for a in admitted)
    assert [s.store.fallbacks for s in services if s.store] == [1, 1, 1]
    assert sum("unreachable" in r.getMessage() for r in caplog.records) == 3
    collected = {m.name: m for m in services[0].store_collector.collect()}  # type: ignore[union-attr]
    assert collected["spine_ratelimit_store_leasing"].samples[0].value == 0.0
    assert collected["spine_ratelimit_store_fallbacks"].samples[0].value == 1.0
    serving, reason = services[0].local_health()  # type: ignore[misc]
    assert serving and "unreachable" in reason and "shares" in reason  # still deciding, and says how
    redis_server.start()  # back (empty): each replica back on leases, one line each, counted
    eventually(lambda: all(s.store and s.store.leasing for s in services))
    renewed(services[0], 3)
    assert sum("reachable again" in r.getMessage() for r in caplog.records) == 3
    assert [s.store.recoveries for s in services if s.store] == [1, 1, 1]
    serving, reason = services[0].local_health()  # type: ignore[misc]
    assert serving and "leasing" in reason


@pytest.mark.parametrize("fail_mode", ["closed", "open"])
def test_the_fail_mode_decides_what_a_replica_admits_without_its_store(
        redis_server: LocalRedis, replicas: Any, fail_mode: str) -> None:
    """`closed`: only the tokens it holds when the store goes (no refill); `open`: each replica
    its whole limit (together more than the limit: what `shares` prevents)."""
    services = replicas(2, fail_mode=fail_mode)
    drive(services, 0.5)
    eventually(lambda: all(s.store and s.store.replicas == 2 for s in services))
    redis_server.stop()
    eventually(lambda: all(s.store and not s.store.leasing for s in services))
    key = (("tenant", "t"), ("model", "m"), ("resource", "requests"))
    held = sum(s.bucket(key).level for s in services)  # type: ignore[union-attr]
    seconds = 1.5
    admitted = sum(drive(services, seconds))
    if fail_mode == "closed":
        assert admitted <= held + 1
        assert sum(drive(services, 0.3)) == 0  # spent: nothing refills it
    else:
        assert admitted > 1.5 * RATE * seconds  # two whole refills: more than one limit's


def test_store_restarted_empty_over_admits_at_most_what_was_leased(
        redis_server: LocalRedis, replicas: Any) -> None:
    services = replicas(3)
    drive(services, 0.5)
    key = (("tenant", "t"), ("model", "m"), ("resource", "requests"))
    held = sum(s.bucket(key).level for s in services)  # type: ignore[union-attr]
    restarted = time.monotonic()
    redis_server.stop()
    redis_server.start()  # same port, no keys
    eventually(lambda: all(s.store and s.store.leasing and s.store.restarts == 1 for s in services),
             seen=lambda: [(s.store.leasing, s.store.restarts, s.store.calls) for s in services if s.store])
    admitted = sum(drive(services, 1.0))
    # Buckets made after the restart start empty: no second burst, only what was held then
    # and the refill since (one renewal of slack), plus every replica's reserve.
    since = time.monotonic() - restarted
    assert admitted <= held + RATE * (since + RENEW_S) + 3 * RESERVE * BURST + 1


def test_store_that_stops_answering_is_a_fallback_too(redis_server: LocalRedis, replicas: Any) -> None:
    services = replicas(2)
    drive(services, 0.3)
    redis_server.pause()
    try:
        eventually(lambda: all(s.store and not s.store.leasing for s in services))
        assert sum(drive(services, 0.5)) > 0  # still deciding, within their shares
    finally:
        redis_server.resume()
    eventually(lambda: all(s.store and s.store.leasing for s in services))


def test_one_replica_cut_off_over_admits_at_most_its_share(redis_server: LocalRedis) -> None:
    """A partition: one of three replicas loses the store (its link cut), the other two keep
    leasing the whole limit; the cut-off one decides on its third: at most a third of the
    limit over, for as long as the partition lasts."""
    link = CuttableLink(redis_server.port)
    prefix = f"p{uuid.uuid4().hex[:8]}:"
    direct = RateLimitConfig.parse(section(redis_server.address, prefix))
    services = [RateLimitService(direct, DeviceContext()) for _ in range(2)]
    services.append(RateLimitService(RateLimitConfig.parse(section(link.address, prefix)), DeviceContext()))
    try:
        drive(services, 0.5)
        eventually(lambda: all(s.store and s.store.replicas == 3 for s in services))
        link.cut()
        eventually(lambda: services[2].store is not None and not services[2].store.leasing)
        assert all(s.store and s.store.leasing for s in services[:2])
        seconds = 1.5
        admitted = drive(services, seconds)
        assert admitted[2] <= limit(seconds) / 3 + BURST / 3 + 1
        assert sum(admitted) <= limit(seconds) * (1 + 1 / 3) + BURST / 3 + 3 * RESERVE * BURST + 1
        link.mend()
        eventually(lambda: services[2].store is not None and services[2].store.leasing)
    finally:
        for service in services:
            service.close()
        link.close()


_HOLDER = """
import sys, time
from monolith.device import DeviceContext
from services.ratelimit.service import RateLimitConfig, RateLimitService
from services.ratelimit.admission import AdmitItem
import json
service = RateLimitService(RateLimitConfig.parse(json.loads(sys.argv[1])), DeviceContext())
held = 0
while held < 2:
    held += service.admit([AdmitItem("c", "m", 10, lease_ttl_s=600)])[0].admitted
    time.sleep(0.02)
time.sleep(0.5)  # renewed with both slots held
print("holding", flush=True)
time.sleep(600)
"""


def test_a_sigkilled_replicas_slots_come_back_after_their_ttl(redis_server: LocalRedis, replicas: Any) -> None:
    import json

    prefix = f"k{uuid.uuid4().hex[:8]}:"
    child = subprocess.Popen([sys.executable, "-c", _HOLDER, json.dumps(section(redis_server.address, prefix))],
                             cwd=REPO, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"holding"
        config = RateLimitConfig.parse(section(redis_server.address, prefix))
        other = RateLimitService(config, DeviceContext())
        try:
            renewed(other, 2)  # it knows the two slots are held elsewhere
            assert not other.admit([AdmitItem("c", "m", 10)])[0].admitted
            assert other.store is not None and other.store.replicas == 2
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=10)
            eventually(lambda: other.admit([AdmitItem("c", "m", 10, lease_ttl_s=600)])[0].admitted,
                     timeout=SLOT_TTL_S + 3.0)
            # and its place among the live replicas: a fallback now divides by one, not two
            eventually(lambda: other.store is not None and other.store.replicas == 1, timeout=SLOT_TTL_S + 3.0)
        finally:
            other.close()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)


def test_concurrency_slots_are_shared_by_the_replicas(replicas: Any) -> None:
    first, second = replicas(2)
    renewed(first, 2)
    leases: list[int] = []

    def admitted() -> bool:
        verdict = first.admit([AdmitItem("c", "m", 10, lease_ttl_s=600)])[0]
        if verdict.admitted:
            leases.append(verdict.lease_id)
        return len(leases) == 2

    eventually(admitted, timeout=5.0, what="two slots leased to the first replica", seen=lambda: leases)
    renewed(second, 2)  # the first holds the limit
    assert not second.admit([AdmitItem("c", "m", 10, lease_ttl_s=600)])[0].admitted
    from wire.v1 import ratelimit_pb2 as pb
    first.ReleaseBatch(pb.ReleaseBatchRequest(items=[pb.ReleaseRequest(lease_id=lease) for lease in leases]))
    eventually(lambda: second.admit([AdmitItem("c", "m", 10, lease_ttl_s=600)])[0].admitted)


# -- config ---------------------------------------------------------------------------------


def test_a_renewal_slower_than_the_lease_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"ratelimit\.store\.renew_interval_s"):
        RateLimitConfig.parse({"store": {"redis": {"address": "127.0.0.1:1"}, "lease_s": 0.5,
                                             "renew_interval_s": 1.0}})
