"""The batched admission decides exactly as the per-request gateway, one request at a time.

Property tests: for random request sequences (tenants, limits, credentials, bad input,
shadow traffic) cut into random batches at random arrival times, every verdict (code,
message, trailers, resolved request, cache hit) and every bucket level after the run
equal those of the per-request pipeline deciding the same requests in arrival order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from monolith.batched import BatchedAdmission, BatchedCompletions, BatchingConfig
from monolith.device import DeviceContext
from services.auth import AuthConfig, AuthService
from services.cache import CacheConfig, CacheService
from services.common import ConfigError
from services.logs import LogsConfig, LogsService
from services.metrics import MetricsConfig, MetricsService
from services.pipeline.gateway import Clients, Gateway, RequestState
from services.pipeline.verdicts import RequestLimits, Stop
from services.ratelimit import RateLimitConfig, RateLimitService
from services.registry import SPECS
from services.router import RouterConfig, RouterService
from spine.runtime.bindings import LocalBinding
from spine.v1 import cache_pb2, generation_pb2, logs_pb2, metrics_pb2
from tests.conftest import DEV_KEY, OTHER_KEY, TIGHT_KEY, config_for_tests, make_jwt

CONFIG = config_for_tests(ratelimit={"tenants": {
    "tight": {"requests_per_second": 0.5, "burst": 4, "tokens_per_minute": 600, "token_burst": 300},
    "other": {"requests_per_second": 2, "burst": 6, "tokens_per_minute": 6000, "token_burst": 2000},
}})
LIMITS = RequestLimits.from_config(CONFIG)
JWT_OK = make_jwt("other", expires_in=3600)
JWT_EXPIRED = make_jwt("dev", expires_in=-3600)
CACHED_PROMPT = "a prompt whose answer is cached"


@dataclass
class Services:
    clock: list[float]
    auth: AuthService
    router: RouterService
    ratelimit: RateLimitService
    cache: CacheService


def make_services() -> Services:
    device = DeviceContext()
    clock = [1000.0]
    services = Services(
        clock,
        AuthService(AuthConfig.from_dict(CONFIG["auth"]), device),
        RouterService(RouterConfig.from_dict(CONFIG["router"]), device),
        RateLimitService(RateLimitConfig.from_dict(CONFIG["ratelimit"]), device, clock=lambda: clock[0]),
        CacheService(CacheConfig.from_dict(CONFIG["cache"]), device, clock=lambda: clock[0]),
    )
    cached = generation_pb2.GenerateRequest(model="tiny-lm", prompt=CACHED_PROMPT, max_tokens=4)
    answer = generation_pb2.GenerateResponse(text="abcd", token_ids=[1, 2, 3, 4], model="tiny-lm",
                                             completion_tokens=4)
    for tenant in ("dev", "tight", "other"):
        services.cache.store(cache_pb2.CacheStoreRequest(tenant=tenant, request=cached, response=answer))
    return services


def sequential_gateway(services: Services) -> Gateway:
    """The per-request pipeline over in-process bindings: the reference."""
    def bind(name: str, servicer: Any) -> LocalBinding:
        return LocalBinding(name, SPECS[name].descriptor(), servicer)

    clients = Clients(auth=bind("auth", services.auth), ratelimit=bind("ratelimit", services.ratelimit),
                      router=bind("router", services.router), cache=bind("cache", services.cache),
                      metrics=None, logs=None, inference=None)
    return Gateway(clients, LIMITS, "collapsed")


def batched(services: Services, **kwargs: Any) -> BatchedAdmission:
    return BatchedAdmission(services.auth, services.router, services.ratelimit, services.cache, LIMITS,
                            BatchingConfig(), **kwargs)


def new_state(token: str | None, shadow: bool = False, index: int = 0) -> RequestState:
    metadata = (("authorization", f"Bearer {token}"),) if token is not None else ()
    return RequestState(request_id=f"r{index}", started=0.0, deadline=float("inf"), shadow=shadow,
                        metadata=metadata)


def verdict(outcome: Any, state: RequestState) -> tuple[Any, ...]:
    seen = (state.tenant, state.model, state.cached, state.completion_tokens, tuple(state.failures))
    if isinstance(outcome, Stop):
        return ("stop", outcome.code, outcome.details, outcome.trailing, *seen)
    resolved, hit = outcome
    return ("go", resolved.SerializeToString(deterministic=True),
            None if hit is None else hit.SerializeToString(deterministic=True), *seen)


def decide_sequentially(gateway: Gateway, request: generation_pb2.GenerateRequest,
                        state: RequestState) -> tuple[Any, ...]:
    try:
        outcome: Any = gateway._admit(request, state, None)
    except Stop as stop:
        outcome = stop
    return verdict(outcome, state)


CREDENTIALS = [TIGHT_KEY, TIGHT_KEY, TIGHT_KEY, TIGHT_KEY, DEV_KEY, OTHER_KEY, OTHER_KEY, JWT_OK, JWT_EXPIRED,
               "not-a-key", None]
# What makes a request bad, if anything (most are good, so buckets run dry inside a batch).
FAULTS: list[dict[str, Any]] = [
    {"model": ""}, {"model": "gpt-9"}, {"prompt": ""}, {"prompt": "x" * 3000}, {"max_tokens": 0},
    {"max_tokens": 300}, {"temperature": 9.0}, {"priority": 5}, {"priority": 1}, {"model": "default"},
]


def make_request(fault: int, prompt: str, max_tokens: int, temperature: float, seed: int | None,
                 ) -> generation_pb2.GenerateRequest:
    fields: dict[str, Any] = {"model": "tiny-lm", "prompt": prompt, "max_tokens": max_tokens,
                              "temperature": temperature}
    if seed is not None:
        fields["seed"] = seed
    if fault < len(FAULTS):
        fields.update(FAULTS[fault])
    return generation_pb2.GenerateRequest(**fields)


TOKENS = st.integers(0, len(CREDENTIALS) - 1).map(lambda i: CREDENTIALS[i])
REQUESTS = st.builds(
    make_request,
    fault=st.integers(0, 3 * len(FAULTS)),
    prompt=st.one_of(st.text("abc ", min_size=1, max_size=30), st.just(CACHED_PROMPT)),
    max_tokens=st.sampled_from([4, 1, 16, 200]),
    temperature=st.sampled_from([0.0, 0.7]),
    seed=st.one_of(st.none(), st.integers(0, 3)),
)
ARRIVALS = st.lists(st.tuples(REQUESTS, TOKENS, st.booleans()), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrivals=ARRIVALS, cuts=st.lists(st.integers(1, 12), min_size=1, max_size=40),
       gaps=st.lists(st.floats(0.0, 3.0), min_size=1, max_size=40))
@example(  # a tenant over its burst inside one batch, some of it shadow traffic, then refilled a little
    arrivals=[(make_request(99, f"p{i}", 4, 0.0, None), TIGHT_KEY, i % 5 == 3) for i in range(14)],
    cuts=[9, 1], gaps=[0.0, 2.5])
def test_batched_admission_equals_sequential_decisions(arrivals: list, cuts: list[int], gaps: list[float]) -> None:
    reference, candidate = make_services(), make_services()
    gateway = sequential_gateway(reference)
    admission = batched(candidate)
    expected, got = [], []
    start = 0
    for batch_number, size in enumerate([*cuts, len(arrivals)]):
        batch = arrivals[start:start + size]
        if not batch:
            break
        now = reference.clock[0] + gaps[batch_number % len(gaps)]  # the batch's arrival time
        reference.clock[0] = candidate.clock[0] = now
        for offset, (request, token, shadow) in enumerate(batch):
            expected.append(decide_sequentially(gateway, request, new_state(token, shadow, start + offset)))
        states = [new_state(token, shadow, start + offset) for offset, (_, token, shadow) in enumerate(batch)]
        from monolith.batched import _Ticket
        tickets = [_Ticket(request, state) for (request, _, _), state in zip(batch, states, strict=True)]
        got += [verdict(o, s) for o, s in zip(admission.decide(tickets), states, strict=True)]
        start += size
    assert got == expected
    assert candidate.ratelimit.snapshot() == reference.ratelimit.snapshot()


def test_an_invalid_request_fails_alone_and_the_rest_of_the_batch_proceeds() -> None:
    admission = batched(make_services())
    from monolith.batched import _Ticket

    def ticket(token: str | None, **fields: Any) -> _Ticket:
        base = {"model": "tiny-lm", "prompt": "hello", "max_tokens": 4}
        return _Ticket(generation_pb2.GenerateRequest(**{**base, **fields}), new_state(token))

    tickets = [ticket(DEV_KEY), ticket(DEV_KEY, prompt=""), ticket(DEV_KEY, model="gpt-9"), ticket(None),
               ticket("wrong"), ticket(DEV_KEY, max_tokens=100000), ticket(TIGHT_KEY, priority=1),
               ticket(DEV_KEY, model="default")]
    outcomes = admission.decide(tickets)
    codes = [o.code if isinstance(o, Stop) else grpc.StatusCode.OK for o in outcomes]
    assert codes == [grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                     grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAUTHENTICATED,
                     grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.OK]
    assert isinstance(outcomes[1], Stop) and outcomes[1].details == "prompt: must not be empty"
    assert isinstance(outcomes[2], Stop) and "unknown model 'gpt-9'" in outcomes[2].details
    assert outcomes[7][0].model == "tiny-lm"  # type: ignore[index]


def test_a_malformed_rate_limit_request_fails_alone_and_the_others_are_charged_once() -> None:
    """The batch is parsed once; the request it names as malformed is taken out with
    INVALID_ARGUMENT and the rest decided again: nobody is charged twice."""
    from dataclasses import replace

    from monolith.batched import _Ticket
    from services.pipeline.verdicts import rate_limit_ask

    services = make_services()
    admission = batched(services)
    request = generation_pb2.GenerateRequest(model="tiny-lm", prompt="hello", max_tokens=4)
    good = rate_limit_ask("tight", request, False)
    bad = replace(good, domain="elsewhere")
    tickets = [_Ticket(request, new_state(TIGHT_KEY, index=i)) for i in range(4)]
    replies = admission._admit_valid(list(zip(tickets, [good, bad, good, bad], strict=True)))
    assert [t for t, _ in replies] == [tickets[0], tickets[2]]
    assert all(r.admitted for _, r in replies)
    for ticket in (tickets[1], tickets[3]):
        assert isinstance(ticket.outcome, Stop) and ticket.outcome.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "domain: expected 'spine', got 'elsewhere'" in ticket.outcome.details
    # Two requests charged, once each: the requests bucket lost exactly 2 from its burst.
    buckets = services.ratelimit.snapshot()
    requests_bucket = next(v for k, v in buckets.items() if "tenant=tight" in k and "resource=requests" in k)
    burst = CONFIG["ratelimit"]["tenants"]["tight"]["burst"]
    assert requests_bucket.level == burst - 2


def test_one_batch_admits_exactly_the_burst_and_tells_the_rest_when_to_retry() -> None:
    services = make_services()
    admission = batched(services)
    from monolith.batched import _Ticket

    tickets = [_Ticket(generation_pb2.GenerateRequest(model="tiny-lm", prompt=f"p{i}", max_tokens=4),
                       new_state(TIGHT_KEY, index=i)) for i in range(10)]
    outcomes = admission.decide(tickets)
    refused = [o for o in outcomes if isinstance(o, Stop)]
    assert len(outcomes) - len(refused) == 4  # the tight tenant's burst
    assert all(o.code == grpc.StatusCode.RESOURCE_EXHAUSTED for o in refused)
    assert all(dict(o.trailing)["retry-after"] for o in refused)
    assert outcomes[:4] == [o for o in outcomes if not isinstance(o, Stop)]  # arrival order wins


def test_a_hook_failure_fails_a_closed_stage_and_is_let_through_by_the_cache() -> None:
    from monolith.batched import _Ticket
    from spine.runtime.faults import FaultHook

    counted: list[tuple[str, str]] = []
    services = make_services()
    for component, expected in (("router", grpc.StatusCode.UNAVAILABLE), ("cache", grpc.StatusCode.OK)):
        counted.clear()
        admission = batched(services, hooks=[FaultHook(component=component, error_rate=1.0)],
                            fail_open=lambda name, reason, rid: counted.append((name, reason)))
        state = new_state(DEV_KEY)
        [outcome] = admission.decide([_Ticket(generation_pb2.GenerateRequest(
            model="tiny-lm", prompt=CACHED_PROMPT, max_tokens=4), state)])
        if expected == grpc.StatusCode.OK:
            assert not isinstance(outcome, Stop) and outcome[1] is None  # a miss, not a failure
            assert counted == [("cache", "UNAVAILABLE")] and state.failures == ["cache"]
        else:
            assert isinstance(outcome, Stop) and outcome.code == expected
            assert "injected fault in router.Resolve" in outcome.details


def test_a_cache_that_fails_for_one_key_fails_open_for_that_request_alone(tmp_path: Any) -> None:
    """The probe is all or nothing, so a failing key is found by probing each alone: that
    request is a counted miss, the others still hit; its deferred store is counted too."""
    from monolith.batched import _Ticket

    counted: list[tuple[str, str]] = []
    services = make_services()
    cached = generation_pb2.GenerateRequest(model="tiny-lm", prompt=CACHED_PROMPT, max_tokens=4)
    broken = generation_pb2.GenerateRequest(model="tiny-lm", prompt="the index cannot take this one", max_tokens=4)
    broken_key = services.cache.key_for("dev", broken)
    probe, store = services.cache.lookup_keys, services.cache.store_key

    def failing_probe(keys: list[bytes | None]) -> list[Any]:
        if broken_key in keys:
            raise RuntimeError("device lost")
        return probe(keys)

    def failing_store(key: bytes, response: Any) -> None:
        if key == broken_key:
            raise RuntimeError("device lost")
        store(key, response)

    services.cache.lookup_keys = failing_probe  # type: ignore[method-assign]
    services.cache.store_key = failing_store  # type: ignore[method-assign]
    admission = batched(services, fail_open=lambda name, reason, rid: counted.append((name, reason)))
    tickets = [_Ticket(request, new_state(DEV_KEY, index=i)) for i, request in enumerate([cached, broken, cached])]
    outcomes = admission.decide(tickets)
    assert [o[1] is not None for o in outcomes] == [True, False, True]  # type: ignore[index]
    assert counted == [("cache", "UNKNOWN")]
    assert [t.state.failures for t in tickets] == [[], ["cache"], []]

    device = DeviceContext()
    metrics = MetricsService(MetricsConfig.from_dict({}), device)
    logs = LogsService(LogsConfig.from_dict({"fsync": False}, tmp_path), device)
    completions = BatchedCompletions(metrics, logs, cache=services.cache, interval_s=3600.0,
                                     fail_open=lambda name, reason, rid: counted.append((name, reason)))
    answer = generation_pb2.GenerateResponse(text="new", model="tiny-lm", completion_tokens=1)
    fine = generation_pb2.GenerateRequest(model="tiny-lm", prompt="stored fine", max_tokens=4)
    for i, request in enumerate([broken, fine]):
        state = new_state(DEV_KEY, index=i)
        state.tenant = "dev"
        assert completions.store(state, request, answer)
    completions.close()
    logs.close()
    assert counted[1:] == [("cache", "UNAVAILABLE")]
    assert 'spine_middleware_failures_total{middleware="cache"} 1.0' in metrics.render()
    assert services.cache.lookup_many([cache_pb2.CacheLookupRequest(tenant="dev", request=fine)])[0].hit


def test_the_store_reuses_the_key_the_batched_probe_made(tmp_path: Any) -> None:
    """Keyed once: the admission's probe keys the request, and its store (after the
    answer) files the response under that same key without hashing the request again."""
    from monolith.batched import _Ticket

    services = make_services()
    request = generation_pb2.GenerateRequest(model="tiny-lm", prompt="keyed once", max_tokens=4)
    state = new_state(DEV_KEY)
    [outcome] = batched(services).decide([_Ticket(request, state)])
    assert not isinstance(outcome, Stop) and outcome[1] is None  # a miss
    assert state.cache_key == services.cache.key_for("dev", request)

    def no_rekeying(tenant: str, request: Any) -> bytes | None:
        raise AssertionError("the store keyed the request again")

    services.cache.key_for = no_rekeying  # type: ignore[method-assign]
    device = DeviceContext()
    metrics = MetricsService(MetricsConfig.from_dict({}), device)
    logs = LogsService(LogsConfig.from_dict({"fsync": False}, tmp_path), device)
    completions = BatchedCompletions(metrics, logs, cache=services.cache, interval_s=3600.0)
    answer = generation_pb2.GenerateResponse(text="once", model="tiny-lm", completion_tokens=1)
    assert completions.store(state, outcome[0], answer)
    completions.close()
    logs.close()
    found = services.cache.lookup_keys([state.cache_key])[0]
    assert found is not None and found.text == "once" and found.cached


def test_completions_write_one_batch_and_keep_the_good_records_when_one_is_bad(tmp_path: Any) -> None:
    device = DeviceContext()
    metrics = MetricsService(MetricsConfig.from_dict({}), device)
    logs = LogsService(LogsConfig.from_dict({"fsync": False}, tmp_path), device)
    failures: list[tuple[str, str, str]] = []
    completions = BatchedCompletions(metrics, logs, fail_open=lambda *args: failures.append(args))
    window = []
    for i, latency in enumerate([0.01, -1.0, 0.02]):
        state = new_state(DEV_KEY, index=i)
        window.append((state, metrics_pb2.RequestRecord(layout="collapsed", model="tiny-lm", tenant="dev",
                                                        status="OK", latency_s=latency),
                       logs_pb2.LogRecord(request_id=state.request_id, tenant="dev", status="OK",
                                          latency_ms=max(latency, 0) * 1000)))
    completions.flush_window(window)
    logs.close()
    assert failures == [("metrics", "INVALID_ARGUMENT", "r1")]
    assert 'spine_requests_total{layout="collapsed",model="tiny-lm",shadow="false",status="OK",tenant="dev"} 2.0' \
        in metrics.render()
    assert (tmp_path / "requests.jsonl").read_text().count("\n") == 3


def test_finished_requests_answer_at_once_and_every_reader_sees_their_records(tmp_path: Any) -> None:
    """A finished request only hands its record and line over; they are written a window
    at a time (one metrics and one log write) — by the folder, or by any reader first:
    a scrape and a log flush always see every request that was answered, and close
    writes what is left."""
    device = DeviceContext()
    metrics = MetricsService(MetricsConfig.from_dict({}), device)
    logs = LogsService(LogsConfig.from_dict({"fsync": False}, tmp_path), device)
    writes: list[int] = []
    record_batch = metrics.record_batch
    metrics.record_batch = lambda records: (writes.append(len(records)), record_batch(records))[1]  # type: ignore[method-assign]
    completions = BatchedCompletions(metrics, logs, interval_s=3600.0)  # the folder never fires here

    def finish(i: int) -> None:
        state = new_state(DEV_KEY, index=i)
        completions.complete(state, metrics_pb2.RequestRecord(layout="collapsed", model="tiny-lm", tenant="dev",
                                                              status="OK", latency_s=0.01),
                             logs_pb2.LogRecord(request_id=state.request_id, tenant="dev", status="OK", latency_ms=10))

    for i in range(3):
        finish(i)
    assert writes == [] and completions.pending == 3  # answered, not yet written
    assert 'shadow="false",status="OK",tenant="dev"} 3.0' in metrics.render()  # the scrape wrote them first
    assert writes == [3]
    finish(3)
    assert logs.flush() == 4  # the flush wrote the fourth, then put every line on disk
    finish(4)
    completions.close()  # shutdown: what is left is written
    finish(5)  # a straggler after close is written at once
    assert writes == [3, 1, 1, 1]
    logs.close()
    assert (tmp_path / "requests.jsonl").read_text().count("\n") == 6


def test_a_response_handed_over_for_the_cache_is_stored_before_the_next_lookup(tmp_path: Any) -> None:
    """The spine stores answers off the request path, yet a repeated request still hits:
    every lookup stores what was handed over first."""
    services = make_services()
    device = DeviceContext()
    metrics = MetricsService(MetricsConfig.from_dict({}), device)
    logs = LogsService(LogsConfig.from_dict({"fsync": False}, tmp_path), device)
    completions = BatchedCompletions(metrics, logs, cache=services.cache, interval_s=3600.0)
    request = generation_pb2.GenerateRequest(model="tiny-lm", prompt="store me later", max_tokens=4)
    answer = generation_pb2.GenerateResponse(text="wxyz", token_ids=[5, 6, 7, 8], model="tiny-lm",
                                             completion_tokens=4)
    state = new_state(DEV_KEY)
    state.tenant = "dev"
    other = generation_pb2.GenerateRequest(model="tiny-lm", prompt="someone else", max_tokens=4)
    entries = len(services.cache._index)
    stale = generation_pb2.GenerateResponse(text="old!", token_ids=[1], model="tiny-lm", completion_tokens=1)
    assert completions.store(state, request, stale)
    assert completions.store(state, request, answer)  # handed over later: the one kept
    assert len(services.cache._index) == entries  # handed over, not stored yet
    services.cache.lookup_many([cache_pb2.CacheLookupRequest(tenant="dev", request=other)])
    assert len(services.cache._index) == entries  # a lookup for another key stores nothing
    found = services.cache.lookup_many([cache_pb2.CacheLookupRequest(tenant="dev", request=request)])[0]
    assert found.hit and found.response.text == "wxyz"
    assert services.cache.stats().entries == entries + 1
    completions.close()
    alone = BatchedCompletions(metrics, logs)  # no local cache: the gateway stores it itself
    assert not alone.store(state, request, answer)
    alone.close()
    logs.close()


def test_a_lookup_waits_for_a_store_another_thread_is_writing(tmp_path: Any) -> None:
    """The folder may have taken an answer off the queue and be storing it when a lookup
    for it arrives: the lookup must wait for that store, not find the queue empty and miss."""
    import threading

    services = make_services()
    device = DeviceContext()
    metrics = MetricsService(MetricsConfig.from_dict({}), device)
    logs = LogsService(LogsConfig.from_dict({"fsync": False}, tmp_path), device)
    completions = BatchedCompletions(metrics, logs, cache=services.cache, interval_s=3600.0)
    store = services.cache.store_key
    storing = threading.Event()

    def slow_store(key: bytes, response: Any) -> None:
        storing.set()
        time.sleep(0.2)
        store(key, response)

    services.cache.store_key = slow_store  # type: ignore[method-assign]
    request = generation_pb2.GenerateRequest(model="tiny-lm", prompt="slow to store", max_tokens=4)
    state = new_state(DEV_KEY)
    state.tenant = "dev"
    completions.store(state, request, generation_pb2.GenerateResponse(text="late", model="tiny-lm"))
    writer = threading.Thread(target=completions.drain_stores)
    writer.start()
    assert storing.wait(5)
    found = services.cache.lookup_many([cache_pb2.CacheLookupRequest(tenant="dev", request=request)])[0]
    writer.join()
    assert found.hit and found.response.text == "late"
    completions.close()
    logs.close()


def test_a_backlog_of_finished_requests_is_written_by_the_requests_themselves(tmp_path: Any) -> None:
    device = DeviceContext()
    metrics = MetricsService(MetricsConfig.from_dict({}), device)
    logs = LogsService(LogsConfig.from_dict({"fsync": False}, tmp_path), device)
    completions = BatchedCompletions(metrics, logs, max_batch=2, interval_s=3600.0)
    for i in range(40):
        state = new_state(DEV_KEY, index=i)
        completions.complete(state, metrics_pb2.RequestRecord(layout="collapsed", model="tiny-lm", tenant="dev",
                                                              status="OK", latency_s=0.01),
                             logs_pb2.LogRecord(request_id=state.request_id, tenant="dev", status="OK", latency_ms=10))
        assert completions.pending < 16  # 8 x max_batch: bounded memory, whoever writes
    completions.close()
    assert completions.stats.items == 40  # every one written once
    logs.close()
    assert (tmp_path / "requests.jsonl").read_text().count("\n") == 40


def test_the_completions_folder_writes_on_its_own_interval(tmp_path: Any) -> None:
    device = DeviceContext()
    metrics = MetricsService(MetricsConfig.from_dict({}), device)
    logs = LogsService(LogsConfig.from_dict({"fsync": False}, tmp_path), device)
    completions = BatchedCompletions(metrics, logs, interval_s=0.01)
    state = new_state(DEV_KEY)
    completions.complete(state, metrics_pb2.RequestRecord(layout="collapsed", model="tiny-lm", tenant="dev",
                                                          status="OK", latency_s=0.01),
                         logs_pb2.LogRecord(request_id=state.request_id, tenant="dev", status="OK", latency_ms=10))
    deadline = time.monotonic() + 5
    while completions.pending and time.monotonic() < deadline:
        time.sleep(0.005)
    assert completions.pending == 0 and completions.stats.batches == 1
    completions.close()
    logs.close()


@pytest.mark.parametrize(("section", "message"), [
    ({"max_batch": 0}, "batching.max_batch"),
    ({"max_wait_us": -5}, "batching.max_wait_us"),
    ({"max_wait_us": 200_000}, r"batching.max_wait_us: must be <= 100000"),
    ({"completion_interval_ms": 0}, "batching.completion_interval_ms"),
    ({"enabled": "yes"}, "batching.enabled"),
    ({"window": 3}, "batching.window: unknown key"),
])
def test_bad_batching_config_names_the_field(section: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        BatchingConfig.from_config({"batching": section})


def test_default_batching_config_is_the_documented_one() -> None:
    assert BatchingConfig.from_config(CONFIG) == BatchingConfig(enabled=True, max_batch=32, max_wait_us=500.0,
                                                                completion_interval_ms=50.0)
