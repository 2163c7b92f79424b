"""The RateLimit service: token buckets, all-or-nothing decisions, batched = sequential."""

from __future__ import annotations

import re
import tempfile
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from monolith.device import DeviceContext
from services.common import ConfigError
from services.ratelimit import (
    MAX_HITS_ADDEND,
    InvalidRateLimitRequest,
    RateLimitAsk,
    RateLimitConfig,
    RateLimitService,
    ask_for,
    descriptors_for,
)
from spine.runtime.bindings import LocalContext, LocalRpcError
from spine.v1 import ratelimit_pb2 as pb
from spine.v1 import ratelimit_pb2_grpc

OK = pb.RateLimitResponse.OK
OVER = pb.RateLimitResponse.OVER_LIMIT
REQUESTS = "tenant=dev,model=tiny-lm,resource=requests"
TOKENS = "tenant=dev,model=tiny-lm,resource=tokens"


class FakeClock:
    """Injected time: tests move it, nothing sleeps."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(limits: dict | None = None, tenants: dict | None = None) -> tuple[RateLimitService, FakeClock]:
    default = {"requests_per_second": 1, "burst": 3, "tokens_per_minute": 60, "token_burst": 100}
    default.update(limits or {})
    clock = FakeClock()
    config = RateLimitConfig.from_dict({"domain": "spine", "default": default, "tenants": tenants or {}})
    return RateLimitService(config, DeviceContext(), clock=clock), clock


def request(tokens: int = 1, tenant: str = "dev", model: str = "tiny-lm", dry_run: bool = False) -> pb.RateLimitRequest:
    return pb.RateLimitRequest(domain="spine", descriptors=descriptors_for(tenant, model, tokens), dry_run=dry_run)


def call(service: RateLimitService, req: pb.RateLimitRequest) -> pb.RateLimitResponse:
    return service.ShouldRateLimit(req, LocalContext())


def status(response: pb.RateLimitResponse, name: str) -> pb.RateLimitResponse.DescriptorStatus:
    return next(s for s in response.statuses if s.limit_name == name)


# -- config ------------------------------------------------------------------------------


def test_default_config_parses_with_the_documented_limits() -> None:
    config_path = Path(__file__).resolve().parents[1] / "spine" / "default_config.yaml"
    section = yaml.safe_load(config_path.read_text())["ratelimit"]
    config = RateLimitConfig.from_dict(section)
    assert config.domain == "spine"
    assert config.default.bucket("requests") == (200.0, 400.0)
    assert config.default.bucket("tokens") == (100_000.0, 1_000_000.0)


def test_tenant_block_overrides_only_the_keys_it_names() -> None:
    config = RateLimitConfig.from_dict(
        {"default": {"requests_per_second": 5, "burst": 10}, "tenants": {"big": {"burst": 50}}}
    )
    assert config.limits_for("big").bucket("requests") == (5.0, 50.0)
    assert config.limits_for("someone-else").bucket("requests") == (5.0, 10.0)


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"default": {"requests_per_second": -1}}, "ratelimit.default.requests_per_second"),
        ({"default": {"tokens_per_minute": 0}}, "ratelimit.default.tokens_per_minute"),
        ({"default": {"burst": 0.5}}, "ratelimit.default.burst"),
        ({"tenants": {"dev": {"token_burst": 0}}}, "ratelimit.tenants.dev.token_burst"),
        ({"tenants": {"dev": {"brust": 3}}}, "ratelimit.tenants.dev.brust"),
        ({"limits": {}}, "ratelimit.limits"),
        ({"domain": ""}, "ratelimit.domain"),
        ({"tenants": {"dev": "fast"}}, "ratelimit.tenants.dev"),
    ],
)
def test_bad_config_raises_config_error_naming_the_field(section: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        RateLimitConfig.from_dict(section)


# -- single decisions ------------------------------------------------------------------------


def test_descriptors_for_builds_a_request_and_a_token_descriptor() -> None:
    requests_d, tokens_d = descriptors_for("dev", "tiny-lm", 42)
    assert [(e.key, e.value) for e in requests_d.entries] == [("tenant", "dev"), ("model", "tiny-lm"), ("resource", "requests")]
    assert requests_d.hits_addend == 1
    assert [(e.key, e.value) for e in tokens_d.entries] == [("tenant", "dev"), ("model", "tiny-lm"), ("resource", "tokens")]
    assert tokens_d.hits_addend == 42


def test_admits_up_to_the_burst_then_denies_naming_the_requests_limit() -> None:
    service, _ = make()
    codes = [call(service, request()).overall_code for _ in range(4)]
    assert codes == [OK, OK, OK, OVER]
    denied = call(service, request())
    assert status(denied, REQUESTS).code == OVER
    assert status(denied, REQUESTS).retry_after_s == pytest.approx(1.0)
    assert status(denied, TOKENS).code == OK


def test_buckets_refill_with_injected_time() -> None:
    service, clock = make({"requests_per_second": 2, "burst": 2})
    assert [call(service, request()).overall_code for _ in range(3)] == [OK, OK, OVER]
    clock.now += 0.25  # half a request earned
    assert call(service, request()).overall_code == OVER
    clock.now += 0.25
    assert call(service, request()).overall_code == OK
    clock.now += 60.0  # refill stops at the burst
    assert [call(service, request()).overall_code for _ in range(3)] == [OK, OK, OVER]


def test_tokens_per_minute_denial_names_the_token_limit_and_when_it_fits() -> None:
    service, _ = make({"tokens_per_minute": 60, "token_burst": 100})  # one token a second
    assert call(service, request(tokens=80)).overall_code == OK
    denied = call(service, request(tokens=50))
    assert denied.overall_code == OVER
    assert status(denied, TOKENS).code == OVER
    assert status(denied, TOKENS).limit_remaining == pytest.approx(20.0)
    assert denied.retry_after_s == pytest.approx(30.0)
    assert status(denied, REQUESTS).code == OK


def test_a_cost_beyond_the_capacity_can_never_fit() -> None:
    service, _ = make({"token_burst": 100})
    denied = call(service, request(tokens=101))
    assert status(denied, TOKENS).retry_after_s == -1.0
    assert denied.retry_after_s == -1.0


def test_a_denied_request_charges_none_of_its_descriptors() -> None:
    service, _ = make({"burst": 5, "token_burst": 100})
    call(service, request(tokens=90))
    before = service.snapshot()
    assert call(service, request(tokens=20)).overall_code == OVER  # tokens deny, requests would fit
    assert service.snapshot() == before
    for _ in range(4):
        call(service, request(tokens=1))
    after_requests_exhausted = service.snapshot()
    assert call(service, request(tokens=1)).overall_code == OVER  # requests deny, tokens would fit
    assert service.snapshot() == after_requests_exhausted


def test_dry_run_decides_without_charging() -> None:
    service, _ = make({"burst": 1})
    assert call(service, request(dry_run=True)).overall_code == OK
    assert call(service, request(dry_run=True)).overall_code == OK
    assert call(service, request()).overall_code == OK
    assert call(service, request(dry_run=True)).overall_code == OVER


def test_tenants_and_models_have_separate_buckets() -> None:
    service, _ = make({"burst": 1}, tenants={"vip": {"burst": 2}})
    assert call(service, request(tenant="dev")).overall_code == OK
    assert call(service, request(tenant="dev")).overall_code == OVER
    assert call(service, request(tenant="dev", model="other")).overall_code == OK
    assert [call(service, request(tenant="vip")).overall_code for _ in range(3)] == [OK, OK, OVER]


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
    config = RateLimitConfig.from_dict(config_dict)
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


# -- share -------------------------------------------------------------------------------------


def test_set_share_scales_capacity_and_rate() -> None:
    service, clock = make({"requests_per_second": 2, "burst": 4})
    service.set_share(0.5)
    assert [call(service, request()).overall_code for _ in range(3)] == [OK, OK, OVER]
    clock.now += 0.5  # at half the rate, half a second earns half a request
    assert call(service, request()).overall_code == OVER
    clock.now += 0.5
    assert call(service, request()).overall_code == OK


def test_raising_the_share_hands_out_no_unearned_tokens() -> None:
    service, _ = make({"burst": 4})
    service.set_share(0.5)
    call(service, request())
    call(service, request())
    service.set_share(1.0)
    assert call(service, request()).overall_code == OVER


def test_share_outside_zero_to_one_is_refused() -> None:
    service, _ = make()
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="share"):
            service.set_share(bad)


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("req", "field"),
    [
        (pb.RateLimitRequest(domain="", descriptors=descriptors_for("dev", "m", 1)), "domain"),
        (pb.RateLimitRequest(domain="other", descriptors=descriptors_for("dev", "m", 1)), "domain"),
        (pb.RateLimitRequest(domain="spine"), "descriptors"),
        (pb.RateLimitRequest(domain="spine", descriptors=[pb.RateLimitDescriptor()]), r"descriptors\[0\]\.entries"),
        (
            pb.RateLimitRequest(
                domain="spine", descriptors=[pb.RateLimitDescriptor(entries=[pb.RateLimitDescriptor.Entry(key="tenant", value="dev")])]
            ),
            r"descriptors\[0\]\.entries: needs resource",
        ),
    ],
)
def test_bad_requests_are_invalid_argument_naming_the_field(req: pb.RateLimitRequest, field: str) -> None:
    service, _ = make()
    with pytest.raises(LocalRpcError) as error:
        call(service, req)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(field, error.value.details())


def test_table_grows_past_its_first_allocation_and_accounts_its_bytes() -> None:
    device = DeviceContext()
    service = RateLimitService(RateLimitConfig.from_dict({}), device, clock=FakeClock())
    service.admit_batch([request(tenant=f"t{i}") for i in range(100)])  # 200 buckets > 64 slots
    assert len(service.snapshot()) == 200
    assert device.usage()["ratelimit"] == 6 * 256 * 8
    assert call(service, request(tenant="t7")).overall_code == OK


def test_running_out_of_device_budget_is_resource_exhausted_and_changes_nothing() -> None:
    device = DeviceContext(budget_bytes=6 * 64 * 8)  # room for the first 64 buckets only
    service = RateLimitService(RateLimitConfig.from_dict({}), device, clock=FakeClock())
    service.admit_batch([request(tenant=f"t{i}") for i in range(32)])
    with pytest.raises(LocalRpcError) as error:
        call(service, request(tenant="one-too-many"))
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(service.snapshot()) == 64
    assert call(service, request(tenant="t0")).overall_code == OK


# -- over the wire -----------------------------------------------------------------------------


@pytest.fixture
def unix_server() -> Iterator[tuple[str, FakeClock]]:
    service, clock = make({"burst": 1})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    ratelimit_pb2_grpc.add_RateLimitServicer_to_server(service, server)
    with tempfile.TemporaryDirectory(prefix="rl") as tmp:
        address = f"unix:{tmp}/ratelimit.sock"
        server.add_insecure_port(address)
        server.start()
        try:
            yield address, clock
        finally:
            server.stop(grace=None)


def test_round_trip_over_a_real_grpc_server_on_a_unix_socket(unix_server: tuple[str, FakeClock]) -> None:
    address, _ = unix_server
    with grpc.insecure_channel(address) as channel:
        stub = ratelimit_pb2_grpc.RateLimitStub(channel)
        assert stub.ShouldRateLimit(request(), timeout=10).overall_code == OK
        denied = stub.ShouldRateLimit(request(), timeout=10)
        assert denied.overall_code == OVER
        assert status(denied, REQUESTS).code == OVER
        with pytest.raises(grpc.RpcError) as error:
            stub.ShouldRateLimit(pb.RateLimitRequest(domain="nope"), timeout=10)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "domain" in str(error.value.details())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.lists(st.tuples(st.sampled_from(["dev", "acme", "zed"]), st.integers(1, 60),
                                             st.booleans()), min_size=1, max_size=12),
                          st.floats(0.0, 3.0)), min_size=1, max_size=8))
def test_the_cpu_fast_paths_and_the_torch_ops_decide_bit_for_bit_alike(batches: list) -> None:
    """On the CPU a table decides on Python floats (a micro-batch) or numpy views (a large
    batch); on CUDA with torch ops. Same answers, same bucket levels, for any batches and times."""
    host, _ = make({"requests_per_second": 2, "burst": 5, "tokens_per_minute": 120, "token_burst": 80})
    torch_ops, _ = make({"requests_per_second": 2, "burst": 5, "tokens_per_minute": 120, "token_burst": 80})
    numpy_ops, _ = make({"requests_per_second": 2, "burst": 5, "tokens_per_minute": 120, "token_burst": 80})
    torch_ops._table.host_paths = False  # the path CUDA takes
    numpy_ops._table.sequential_max = 0  # a large batch on the CPU: numpy's cumulative sums
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
    config = RateLimitConfig.from_dict(config_dict)
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
    service = RateLimitService(RateLimitConfig.from_dict({}), DeviceContext())
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
    service = RateLimitService(RateLimitConfig.from_dict({}), DeviceContext())
    negative = RateLimitAsk("spine", ((ask_for("dev", "tiny-lm", 5).descriptors[0][0], -3),))  # would credit it
    with pytest.raises(InvalidRateLimitRequest, match=r"descriptors\[0\]\.hits_addend: must be >= 0, got -3"):
        service._decide([negative], None)
    assert service.snapshot() == {}
