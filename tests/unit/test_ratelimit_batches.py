"""The RateLimit service decides a batch exactly as one by one, on every path."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from monolith.device import DeviceContext
from services.ratelimit.asks import InvalidRateLimitRequest, RateLimitAsk, ask_for, descriptors_for
from services.ratelimit.service import MAX_HITS_ADDEND, RateLimitConfig, RateLimitService
from tests.integration.test_ratelimit import OK, OVER, REQUESTS, TOKENS, FakeClock, call, make, request
from wire.v1 import ratelimit_pb2 as pb

# -- batches -----------------------------------------------------------------------------------


def test_batch_admits_a_later_smaller_request_after_an_earlier_denial() -> None:
    service, _ = make({"burst": 10, "token_burst": 10})
    codes = [r.overall_code for r in service.admit_batch([request(5), request(8), request(3), request(2)])]
    assert codes == [OK, OVER, OK, OK]


def test_batch_is_all_or_nothing_across_descriptors_with_different_costs() -> None:
    service, _ = make({"burst": 2, "token_burst": 10})
    # 2nd is denied on tokens (so it must not use a request), letting the 3rd use the last request.
    codes = [r.overall_code for r in service.admit_batch([request(6), request(6), request(4), request(1)])]
    assert codes == [OK, OVER, OK, OVER]


def test_ten_times_overload_admits_exactly_the_budget() -> None:
    # 8 requests/s with a burst of 8, over 10 s in 80 windows of 1/8 s: budget 8 + 80 = 88.
    service, clock = make({"requests_per_second": 8, "burst": 8, "token_burst": 1_000_000, "tokens_per_minute": 1e9})
    start = clock.now
    admitted = 0
    for window in range(81):
        batch = [request(tokens=7) for _ in range(11)]
        admitted += sum(r.overall_code == OK for r in service.admit_batch(batch, now=start + window / 8))
    assert admitted == 88


def test_an_invalid_request_in_a_batch_is_named_and_nothing_is_charged() -> None:
    service, _ = make()
    bad = pb.RateLimitRequest(domain="spine")
    with pytest.raises(InvalidRateLimitRequest, match="descriptors") as error:
        service.admit_batch([request(), bad])
    assert error.value.index == 1
    assert service.snapshot() == {}


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[dict, list]:
    def limits() -> dict:
        return {
            "requests_per_second": draw(st.sampled_from([0.1, 0.5, 1, 3, 7])),
            "burst": draw(st.integers(1, 6)),
            "tokens_per_minute": draw(st.sampled_from([7, 60, 100, 600, 1000])),
            "token_burst": draw(st.integers(1, 60)),
        }

    config = {"domain": "spine", "default": limits(), "tenants": {"b": limits()}}
    one = st.tuples(
        st.sampled_from(["a", "b", "c"]),
        st.sampled_from(["m1", "m2"]),
        st.integers(0, 70),
        st.booleans(),  # dry run
        st.sampled_from(["pair", "tokens-only", "twice"]),
    )
    steps = draw(
        st.lists(
            st.tuples(
                st.sampled_from([0.0, 0.0, 0.001, 0.1, 0.37, 1.0, 2.5, 30.0]),
                st.lists(one, min_size=1, max_size=14),
                st.sampled_from([None, None, None, 0.5, 1.0, 0.3]),
            ),
            min_size=2,
            max_size=6,
        )
    )
    return config, steps


def build(tenant: str, model: str, tokens: int, dry_run: bool, shape: str) -> pb.RateLimitRequest:
    pair = descriptors_for(tenant, model, tokens)
    descriptors = {"pair": pair, "tokens-only": pair[1:], "twice": [pair[1], pair[1], pair[0]]}[shape]
    return pb.RateLimitRequest(domain="spine", descriptors=descriptors, dry_run=dry_run)


class ReferenceBuckets:
    """Token buckets in plain Python floats, one request at a time: the contract, not the tensors."""

    def __init__(self, config: RateLimitConfig) -> None:
        self.config = config
        self.share = 1.0
        self.buckets: dict[str, list[float]] = {}  # name -> [level, last, base rate, base capacity]

    def set_share(self, share: float) -> None:
        self.share = share
        for bucket in self.buckets.values():
            bucket[0] = min(bucket[0], bucket[3] * share)

    def decide(self, req: pb.RateLimitRequest, now: float) -> int:
        cost: dict[str, float] = {}
        for d in req.descriptors:
            fields = {e.key: e.value for e in d.entries}
            name = ",".join(f"{e.key}={e.value}" for e in d.entries)
            if name not in self.buckets:
                rate, capacity = self.config.limits_for(fields["tenant"]).bucket(fields["resource"])
                self.buckets[name] = [capacity * self.share, now, rate, capacity]
            level, last, rate, capacity = self.buckets[name]
            elapsed = max(0.0, now - last)
            self.buckets[name][:2] = [min(capacity * self.share, level + rate * self.share * elapsed), max(last, now)]
            cost[name] = cost.get(name, 0.0) + float(d.hits_addend or 1)
        admitted = all(c <= self.buckets[name][0] for name, c in cost.items())
        if admitted and not req.dry_run:
            for name, c in cost.items():
                self.buckets[name][0] -= c
        return OK if admitted else OVER


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_admit_batch_equals_deciding_one_by_one(scenario: tuple[dict, list]) -> None:
    config_dict, steps = scenario
    config = RateLimitConfig.parse(config_dict)
    clock = FakeClock()
    batched = RateLimitService(config, DeviceContext(), clock=clock)
    sequential = RateLimitService(config, DeviceContext(), clock=clock)
    reference = ReferenceBuckets(config)
    for dt, batch, share in steps:
        clock.now += dt
        if share is not None:
            batched.set_share(share)
            sequential.set_share(share)
            reference.set_share(share)
        requests = [build(*spec) for spec in batch]
        expected = [call(sequential, r) for r in requests]
        assert batched.admit_batch(requests, now=clock.now) == expected
        assert batched.snapshot() == sequential.snapshot()
        assert [r.overall_code for r in expected] == [reference.decide(r, clock.now) for r in requests]
        assert {name: b.level for name, b in batched.snapshot().items()} == {
            name: b[0] for name, b in reference.buckets.items()
        }



@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.lists(st.tuples(st.sampled_from(["dev", "acme", "zed"]), st.integers(1, 60),
                                             st.booleans()), min_size=1, max_size=12),
                          st.floats(0.0, 3.0)), min_size=1, max_size=8))
@pytest.mark.parametrize("leased", [False, True], ids=["refilling", "leased"])
def test_the_cpu_fast_paths_and_the_torch_ops_decide_bit_for_bit_alike(leased: bool, batches: list) -> None:
    """On the CPU a table decides on Python floats (a micro-batch) or numpy views (a large
    batch); on CUDA with torch ops. Same answers, same bucket levels, for any batches and times;
    also in lease mode (`ratelimit.store`: no refill, retry-after from the configured rate)."""
    host, _ = make({"requests_per_second": 2, "burst": 5, "tokens_per_minute": 120, "token_burst": 80})
    torch_ops, _ = make({"requests_per_second": 2, "burst": 5, "tokens_per_minute": 120, "token_burst": 80})
    numpy_ops, _ = make({"requests_per_second": 2, "burst": 5, "tokens_per_minute": 120, "token_burst": 80})
    torch_ops._table.host_paths = False  # the path CUDA takes
    numpy_ops._table.sequential_max = 0  # a large batch on the CPU: numpy's cumulative sums
    if leased:
        for service in (host, torch_ops, numpy_ops):
            service._table.lease(0.6)
    now = 100.0
    for batch, advance in batches:
        now += advance
        requests = [request(tokens, tenant, dry_run=dry) for tenant, tokens, dry in batch]
        expected = torch_ops.admit_batch(requests, now=now)
        assert host.admit_batch(requests, now=now) == expected
        assert numpy_ops.admit_batch(requests, now=now) == expected
    assert host.snapshot() == torch_ops.snapshot() == numpy_ops.snapshot()


def admit(service: RateLimitService, items: list[pb.AdmitRequest]) -> list[pb.AdmitResult]:
    return list(service.AdmitBatch(pb.AdmitBatchRequest(items=items)).results)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_admit_batch_decides_and_charges_exactly_as_should_rate_limit(scenario: tuple[dict, list]) -> None:
    """The pipeline's flat ask and the descriptor form: the same verdicts and the same bucket
    levels, batch after batch (the ask is the gateway's pair of descriptors)."""
    config_dict, steps = scenario
    config = RateLimitConfig.parse(config_dict)
    clock = FakeClock()
    flat = RateLimitService(config, DeviceContext(), clock=clock)
    descriptors = RateLimitService(config, DeviceContext(), clock=clock)
    for dt, batch, share in steps:
        clock.now += dt
        if share is not None:
            flat.set_share(share)
            descriptors.set_share(share)
        asks = [(tenant, model, tokens, dry_run) for tenant, model, tokens, dry_run, _ in batch]
        expected = descriptors.admit_batch([build(*ask, "pair") for ask in asks], now=clock.now)
        results = admit(flat, [pb.AdmitRequest(tenant=a, model=m, tokens=n, dry_run=d) for a, m, n, d in asks])
        assert all(result.status.code == 0 for result in results)
        for result, reference in zip(results, expected, strict=True):
            assert result.response.admitted == (reference.overall_code == OK)
            assert [(o.limit_name, o.retry_after_s) for o in result.response.over] == [
                (s.limit_name, s.retry_after_s) for s in reference.statuses if s.code == OVER]
            assert result.response.retry_after_s == reference.retry_after_s
        assert flat.snapshot() == descriptors.snapshot()


def test_an_ask_round_trips_through_its_proto_and_the_gateway_sends_the_documented_pair() -> None:
    ask = ask_for("dev", "tiny-lm", 42, dry_run=True)
    assert RateLimitAsk.from_proto(ask.to_proto()) == ask
    assert ask.to_proto() == pb.RateLimitRequest(domain="spine", descriptors=descriptors_for("dev", "tiny-lm", 42),
                                                 dry_run=True)
    assert [hits for _, hits in ask.descriptors] == [1, 42]
    assert [dict(key)["resource"] for key, _ in ask.descriptors] == ["requests", "tokens"]


def test_a_malformed_item_is_refused_alone_and_the_rest_decided() -> None:
    service = RateLimitService(RateLimitConfig.parse({}), DeviceContext())
    too_big, empty, good = admit(service, [
        pb.AdmitRequest(tenant="dev", model="tiny-lm", tokens=MAX_HITS_ADDEND + 1),
        pb.AdmitRequest(tenant="", model="tiny-lm", tokens=1),
        pb.AdmitRequest(tenant="dev", model="tiny-lm", tokens=5),
    ])
    invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert too_big.status.code == invalid and "hits_addend: at most" in too_big.status.message
    assert empty.status.code == invalid and empty.status.message == "tenant: must not be empty"
    assert good.status.code == 0 and good.response.admitted
    assert set(service.snapshot()) == {REQUESTS, TOKENS}  # only the good one was charged


def test_a_negative_hits_addend_is_refused_before_any_bucket_changes() -> None:
    service = RateLimitService(RateLimitConfig.parse({}), DeviceContext())
    negative = RateLimitAsk("spine", ((ask_for("dev", "tiny-lm", 5).descriptors[0][0], -3),))  # would credit it
    with pytest.raises(InvalidRateLimitRequest, match=r"descriptors\[0\]\.hits_addend: must be >= 0, got -3"):
        service._decide([negative], None)
    assert service.snapshot() == {}
