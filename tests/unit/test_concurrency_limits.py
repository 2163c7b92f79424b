"""Concurrency tiers in the rate limiter: leases on a tenant's slots, their release and expiry,
a traffic split's share, halving while the device is busy, and batch = one by one."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from monolith.device import DeviceContext
from services.common import ConfigError
from services.pipeline.local_context import LocalContext
from services.ratelimit.concurrency import MIN_RETRY_S, ConcurrencyLeases
from services.ratelimit.service import RateLimitConfig, RateLimitService
from tests.batch_of_one import one
from tests.integration.test_ratelimit import FakeClock
from wire.v1 import ratelimit_pb2 as pb

CONCURRENCY = "tenant={},resource=concurrent_requests"
ROOMY = {"requests_per_second": 1000, "burst": 1000, "tokens_per_minute": 1e9, "token_burst": 1e6}


def make(tenants: dict[str, Any] | None = None, **section: Any) -> tuple[RateLimitService, FakeClock]:
    clock = FakeClock()
    config = RateLimitConfig.parse({"default": ROOMY, "tenants": tenants or {"free": {"max_concurrent_requests": 2}},
                                        **section})
    return RateLimitService(config, DeviceContext(), clock=clock), clock


def item(tenant: str = "free", *, ttl: float = 30.0, dry_run: bool = False, tokens: int = 10,
         busy: float = 0.0) -> pb.AdmitRequest:
    return pb.AdmitRequest(tenant=tenant, model="tiny-lm", tokens=tokens, dry_run=dry_run, lease_ttl_s=ttl, busy=busy)


def admit(service: RateLimitService, *items: pb.AdmitRequest) -> list[pb.AdmitResponse]:
    answer = service.AdmitBatch(pb.AdmitBatchRequest(items=list(items)))
    assert all(result.status.code == 0 for result in answer.results)
    return [result.response for result in answer.results]


def release(service: RateLimitService, *leases: int) -> list[bool]:
    answer = service.ReleaseBatch(pb.ReleaseBatchRequest(items=[pb.ReleaseRequest(lease_id=lease) for lease in leases]))
    return [result.response.released for result in answer.results]


# -- config --------------------------------------------------------------------------------


def test_max_concurrent_requests_is_inherited_from_the_default_and_null_means_unlimited() -> None:
    config = RateLimitConfig.parse({"default": {"max_concurrent_requests": 8},
                                        "tenants": {"free": {"max_concurrent_requests": 2}, "pro": {"burst": 50},
                                                    "internal": {"max_concurrent_requests": None}}})
    assert [config.limits_for(t).max_concurrent_requests for t in ("free", "pro", "internal", "anyone")] == [2, 8, None, 8]
    assert RateLimitConfig.parse(None).default.max_concurrent_requests is None


@pytest.mark.parametrize(("section", "path"), [
    ({"default": {"max_concurrent_requests": 0}}, "ratelimit.default.max_concurrent_requests"),
    ({"concurrency_when_busy": {"above": 0.8, "below": 0.9}}, "ratelimit.concurrency_when_busy.below"),
    ({"concurrency_when_busy": {"above": 1.5}}, "ratelimit.concurrency_when_busy.above"),
])
def test_a_bad_concurrency_setting_is_refused_naming_the_field(section: dict[str, Any], path: str) -> None:
    with pytest.raises(ConfigError, match=path.replace(".", r"\.")):
        RateLimitConfig.parse(section)


# -- leases --------------------------------------------------------------------------------


def test_six_at_once_with_a_limit_of_two_admits_two_holding_leases_and_refuses_four_with_retry_after() -> None:
    service, _ = make()
    answers = admit(service, *[item() for _ in range(6)])
    assert [a.admitted for a in answers] == [True, True, False, False, False, False]
    assert all(a.lease_id for a in answers[:2]) and answers[0].lease_id != answers[1].lease_id
    for refused in answers[2:]:
        assert refused.lease_id == 0 and refused.retry_after_s >= MIN_RETRY_S
        assert [over.limit_name for over in refused.over] == [CONCURRENCY.format("free")]
    assert service.in_flight() == {"free": 2}


def test_a_released_slot_admits_the_next_request() -> None:
    service, _ = make()
    first, second = admit(service, item(), item())
    assert not admit(service, item())[0].admitted
    assert release(service, first.lease_id) == [True]
    assert release(service, first.lease_id) == [False]  # once only
    assert admit(service, item())[0].admitted
    assert service.in_flight() == {"free": 2}
    assert release(service, second.lease_id, 12345) == [True, False]  # an unknown lease is not refused


def test_a_lease_expires_at_the_requests_deadline() -> None:
    service, clock = make()
    admit(service, item(ttl=5.0), item(ttl=60.0))
    clock.now += 4.9
    assert not admit(service, item())[0].admitted
    clock.now += 0.2  # the first request's deadline has passed: its gateway never released it
    answer = admit(service, item())[0]
    assert answer.admitted and service.in_flight() == {"free": 2}


def test_retry_after_is_when_the_oldest_slot_should_free_up() -> None:
    service, clock = make()
    for _ in range(4):  # the tenant's requests have held their slot for 3 s each
        lease = admit(service, item())[0].lease_id
        clock.now += 3.0
        release(service, lease)
    admit(service, item(ttl=30.0), item(ttl=30.0))
    clock.now += 1.0
    wait = admit(service, item())[0].retry_after_s
    assert 0.5 < wait < 3.0  # about the average hold (~2.2 s after 4 samples from 1 s) minus the 1 s held


def test_a_refused_request_charges_no_bucket_and_a_dry_run_takes_no_slot() -> None:
    service, _ = make()
    admit(service, item(), item())
    before = service.snapshot()
    refused, shadow = admit(service, item(tokens=500), item(dry_run=True))
    assert not refused.admitted and not shadow.admitted  # the shadow copy is decided as the real one would be
    assert service.snapshot() == before
    service, _ = make()
    assert [(a.admitted, a.lease_id) for a in admit(service, item(dry_run=True), item(dry_run=True))] == [(True, 0)] * 2
    assert service.in_flight() == {}


def test_a_tenant_without_a_limit_takes_no_lease() -> None:
    service, _ = make()
    answers = admit(service, *[item("pro") for _ in range(50)])
    assert all(a.admitted and a.lease_id == 0 for a in answers)


def test_the_per_request_rpcs_are_the_batch_of_one() -> None:
    service, _ = make()
    context = LocalContext()
    lease = one(service.AdmitBatch(pb.AdmitBatchRequest(items=[item()]), context)).lease_id
    assert lease and one(service.ReleaseBatch(pb.ReleaseBatchRequest(items=[pb.ReleaseRequest(lease_id=lease)]),
                                              context)).released


# -- shares and busy halving --------------------------------------------------------------


@pytest.mark.parametrize(("configured", "share", "enforced"), [(4, 0.5, 2), (5, 0.5, 2), (2, 0.5, 1), (2, 0.01, 1),
                                                                (16, 1.0, 16), (16, 0.25, 4)])
def test_each_side_enforces_its_share_rounded_down_and_at_least_one(configured: int, share: float,
                                                                    enforced: int) -> None:
    service, _ = make({"t": {"max_concurrent_requests": configured}})
    service.set_share(share)
    answers = admit(service, *[item("t") for _ in range(20)])
    assert sum(a.admitted for a in answers) == enforced == service.concurrency_limit("t")


def test_the_limit_is_halved_while_the_device_is_busy_with_hysteresis() -> None:
    service, _ = make({"pro": {"max_concurrent_requests": 16}},
                      concurrency_when_busy={"halve": True, "above": 0.9, "below": 0.8})
    assert service.concurrency_limit("pro") == 16
    for busy, limit in [(0.85, 16), (0.95, 8), (0.85, 8), (0.79, 16), (0.91, 8), (0.0, 16)]:
        admit(service, item("pro", busy=busy, dry_run=True))
        assert service.concurrency_limit("pro") == limit, busy


def test_halving_is_off_unless_configured_and_keeps_slots_already_held() -> None:
    service, _ = make({"pro": {"max_concurrent_requests": 4}})
    admit(service, item("pro", busy=1.0, dry_run=True))
    assert service.concurrency_limit("pro") == 4
    service, _ = make({"pro": {"max_concurrent_requests": 4}}, concurrency_when_busy={"halve": True})
    assert sum(a.admitted for a in admit(service, *[item("pro") for _ in range(4)])) == 4
    assert not admit(service, item("pro", busy=0.99))[0].admitted  # 4 held, limit now 2: none revoked
    assert service.in_flight() == {"pro": 4}


def test_the_lease_table_alone() -> None:
    leases = ConcurrencyLeases(halve_when_busy=True)
    assert leases.limit(3) == 3
    leases.share = 0.5
    assert leases.limit(3) == 1
    leases.observe_busy(0.95)
    assert leases.limit(8) == 2 and leases.limit(1) == 1


# -- batch = one by one --------------------------------------------------------------------


@st.composite
def traffic(draw: st.DrawFn) -> list[tuple[str, Any]]:
    """Admits and releases of three tenants (two with limits), some dry runs, some costly."""
    steps: list[tuple[str, Any]] = []
    for _ in range(draw(st.integers(1, 8))):
        if draw(st.booleans()):
            steps.append(("release", draw(st.integers(0, 50))))
        batch = [(draw(st.sampled_from(["a", "b", "c"])), draw(st.booleans()) and draw(st.booleans()),
                  draw(st.sampled_from([10, 10, 10, 400])))
                 for _ in range(draw(st.integers(1, 12)))]
        steps.append(("admit", batch))
    return steps


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traffic())
def test_a_batch_gets_exactly_the_answers_of_one_by_one(steps: list[tuple[str, Any]]) -> None:
    tenants = {"a": {"max_concurrent_requests": 2, "token_burst": 1000}, "b": {"max_concurrent_requests": 3},
               "c": {"token_burst": 500}}
    batched, _ = make(tenants)
    single, _ = make(tenants)
    held: list[tuple[int, int]] = []
    for kind, payload in steps:
        if kind == "release":
            if held:
                a, b = held.pop(payload % len(held))
                assert release(batched, a) == release(single, b)
            continue
        items = [item(tenant, dry_run=dry, tokens=tokens) for tenant, dry, tokens in payload]
        together = admit(batched, *items)
        alone = [admit(single, one)[0] for one in items]
        assert [(a.admitted, [o.limit_name for o in a.over], bool(a.lease_id)) for a in together] == \
               [(a.admitted, [o.limit_name for o in a.over], bool(a.lease_id)) for a in alone]
        held.extend((a.lease_id, b.lease_id) for a, b in zip(together, alone, strict=True) if a.lease_id)
        assert batched.snapshot() == single.snapshot() and batched.in_flight() == single.in_flight()
