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

from monolith.device import DeviceContext
from services.common import ConfigError
from services.pipeline.local_context import LocalContext, LocalRpcError
from services.ratelimit.asks import descriptors_for
from services.ratelimit.service import RateLimitConfig, RateLimitService
from wire.v1 import ratelimit_pb2 as pb
from wire.v1 import ratelimit_pb2_grpc

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
    config = RateLimitConfig.parse({"domain": "spine", "default": default, "tenants": tenants or {}})
    return RateLimitService(config, DeviceContext(), clock=clock), clock


def request(tokens: int = 1, tenant: str = "dev", model: str = "tiny-lm", dry_run: bool = False) -> pb.RateLimitRequest:
    return pb.RateLimitRequest(domain="spine", descriptors=descriptors_for(tenant, model, tokens), dry_run=dry_run)


def call(service: RateLimitService, req: pb.RateLimitRequest) -> pb.RateLimitResponse:
    return service.ShouldRateLimit(req, LocalContext())


def status(response: pb.RateLimitResponse, name: str) -> pb.RateLimitResponse.DescriptorStatus:
    return next(s for s in response.statuses if s.limit_name == name)


# -- config ------------------------------------------------------------------------------


def test_default_config_parses_with_the_documented_limits() -> None:
    config_path = Path(__file__).resolve().parents[2] / "runtime" / "default_config.yaml"
    section = yaml.safe_load(config_path.read_text())["ratelimit"]
    config = RateLimitConfig.parse(section)
    assert config.domain == "spine"
    assert config.default.bucket("requests") == (200.0, 400.0)
    assert config.default.bucket("tokens") == (100_000.0, 1_000_000.0)


def test_tenant_block_overrides_only_the_keys_it_names() -> None:
    config = RateLimitConfig.parse(
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
        RateLimitConfig.parse(section)


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
    service = RateLimitService(RateLimitConfig.parse({}), device, clock=FakeClock())
    service.admit_batch([request(tenant=f"t{i}") for i in range(100)])  # 200 buckets > 64 slots
    assert len(service.snapshot()) == 200
    assert device.usage()["ratelimit"] == 6 * 256 * 8
    assert call(service, request(tenant="t7")).overall_code == OK


def test_running_out_of_device_budget_is_resource_exhausted_and_changes_nothing() -> None:
    device = DeviceContext(budget_bytes=6 * 64 * 8)  # room for the first 64 buckets only
    service = RateLimitService(RateLimitConfig.parse({}), device, clock=FakeClock())
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
