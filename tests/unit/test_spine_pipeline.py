"""The pipeline decides a batch exactly as it decides the same requests one at a time.

Property tests: for random request sequences (tenants, limits, credentials, bad input,
shadow traffic) cut into random batches at random arrival times, every verdict (code,
message, trailers, resolved request, cache hit) and every bucket level after the run
equal those of the same steps deciding the same requests one by one in arrival order.
Then the spine's scheduling of the completions (`monolith.batched_pipeline.DeferredCompletions`):
answers go out at once, writes happen a window at a time, and nothing is lost or unseen.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from monolith.batched_pipeline import BatchingConfig, DeferredCompletions
from monolith.device import DeviceContext
from runtime.faults import FaultHook
from runtime.placement.in_process import in_process
from services.auth.service import AuthService
from services.cache.api import CACHE, StoreItem
from services.cache.service import CacheService
from services.common import ConfigError
from services.logs.config import LogsConfig
from services.logs.service import LogsService
from services.metrics.api import METRICS
from services.metrics.service import MetricsConfig, MetricsService
from services.pipeline.interface import Placed
from services.pipeline.pipeline import Pipeline
from services.pipeline.state import RequestState
from services.ratelimit.service import RateLimitService
from services.registry import DEFAULT
from services.router.service import RouterService
from tests.conftest import DEV_KEY, OTHER_KEY, TIGHT_KEY, config_for_tests, make_jwt
from tests.waiting import eventually
from wire.v1 import generation_pb2

CONFIG = config_for_tests(ratelimit={"tenants": {
    "tight": {"requests_per_second": 0.5, "burst": 4, "tokens_per_minute": 600, "token_burst": 300},
    "other": {"requests_per_second": 2, "burst": 6, "tokens_per_minute": 6000, "token_burst": 2000},
}})
LIMITS = CONFIG.limits
JWT_OK = make_jwt("other", expires_in=3600)
JWT_EXPIRED = make_jwt("dev", expires_in=-3600)
CACHED_PROMPT = "a prompt whose answer is cached"
ALL_WRITES = ("cache.store", "logs.append", "metrics.record")


class Rig:
    """The pipeline over real services placed in this process, as the spine wires them."""

    def __init__(self, tmp_path: Path | None = None, hooks: Any = ()) -> None:
        device = DeviceContext()
        self.clock = [1000.0]
        self.counted: list[tuple[str, str, str]] = []
        self.servicers: dict[str, Any] = {
            "auth": AuthService(CONFIG.auth, device),
            "router": RouterService(CONFIG.router, device),
            "ratelimit": RateLimitService(CONFIG.ratelimit, device,
                                          clock=lambda: self.clock[0]),
            "cache": CacheService(CONFIG.cache, device, clock=lambda: self.clock[0]),
        }
        if tmp_path is not None:
            self.servicers["metrics"] = MetricsService(MetricsConfig.parse({}), device)
            self.servicers["logs"] = LogsService(LogsConfig.parse({"fsync": False}), device, run_dir=tmp_path)
        self.placed = Placed({name: in_process(self._interface(name), servicer)
                              for name, servicer in self.servicers.items()})
        self.pipeline = Pipeline(DEFAULT.steps(LIMITS), self.placed, hooks=hooks,
                                 on_fail_open=lambda *failure: self.counted.append(failure))
        cached = generation_pb2.GenerateRequest(model="tiny-lm", prompt=CACHED_PROMPT, max_tokens=4)
        answer = generation_pb2.GenerateResponse(text="abcd", token_ids=[1, 2, 3, 4], model="tiny-lm",
                                                 completion_tokens=4)
        for tenant in ("dev", "tight", "other"):
            self.cache.store([StoreItem(tenant, answer, request=cached)])


    @staticmethod
    def _interface(name: str) -> Any:
        interface = DEFAULT[name].interface
        assert interface is not None
        return interface

    @property
    def cache(self) -> CacheService:
        return self.servicers["cache"]

    @property
    def ratelimit(self) -> RateLimitService:
        return self.servicers["ratelimit"]

    def close(self) -> None:
        if "logs" in self.servicers:
            self.servicers["logs"].close()


def new_state(token: str | None, request: generation_pb2.GenerateRequest | None = None, *, shadow: bool = False,
              index: int = 0) -> RequestState:
    metadata = (("authorization", f"Bearer {token}"),) if token is not None else ()
    request = request or generation_pb2.GenerateRequest(model="tiny-lm", prompt=f"p{index}", max_tokens=4)
    return RequestState(request=request, request_id=f"r{index}", layout="collapsed", started=time.perf_counter(),
                        deadline=time.monotonic() + 3600, shadow=shadow, metadata=metadata, model=request.model)


def verdict(state: RequestState) -> tuple[Any, ...]:
    seen = (state.tenant, state.model, state.cached, state.completion_tokens, tuple(state.failures))
    if state.outcome is not None:
        return ("stop", state.outcome.code, state.outcome.details, state.outcome.trailing, *seen)
    assert state.resolved is not None
    return ("go", state.resolved.SerializeToString(deterministic=True),
            None if state.hit is None else state.hit.SerializeToString(deterministic=True), *seen)


def sample(text: str, name: str, **labels: str) -> float:
    """One sample's value from an exposition (0 when absent)."""
    for family in text_string_to_metric_families(text):
        for found in family.samples:
            if found.name == name and all(found.labels.get(k) == v for k, v in labels.items()):
                return found.value
    return 0.0


def answered(state: RequestState, text: str = "fresh") -> RequestState:
    """A state as the gateway hands it over once the model has answered."""
    state.response = generation_pb2.GenerateResponse(text=text, model="tiny-lm", completion_tokens=1)
    state.latency_s = 0.01
    return state


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
    reference, candidate = Rig(), Rig()
    expected, got = [], []
    start = 0
    for batch_number, size in enumerate([*cuts, len(arrivals)]):
        batch = arrivals[start:start + size]
        if not batch:
            break
        now = reference.clock[0] + gaps[batch_number % len(gaps)]  # the batch's arrival time
        reference.clock[0] = candidate.clock[0] = now
        for offset, (request, token, shadow) in enumerate(batch):
            state = new_state(token, request, shadow=shadow, index=start + offset)
            reference.pipeline.admit([state])
            expected.append(verdict(state))
        states = [new_state(token, request, shadow=shadow, index=start + offset)
                  for offset, (request, token, shadow) in enumerate(batch)]
        candidate.pipeline.admit(states)
        got += [verdict(state) for state in states]
        start += size
    assert got == expected
    assert candidate.ratelimit.snapshot() == reference.ratelimit.snapshot()


def test_an_invalid_request_fails_alone_and_the_rest_of_the_batch_proceeds() -> None:
    rig = Rig()

    def state(token: str | None, **fields: Any) -> RequestState:
        base = {"model": "tiny-lm", "prompt": "hello", "max_tokens": 4}
        return new_state(token, generation_pb2.GenerateRequest(**{**base, **fields}))

    batch = [state(DEV_KEY), state(DEV_KEY, prompt=""), state(DEV_KEY, model="gpt-9"), state(None),
             state("wrong"), state(DEV_KEY, max_tokens=100000), state(TIGHT_KEY, priority=1),
             state(DEV_KEY, model="default")]
    rig.pipeline.admit(batch)
    codes = [s.outcome.code if s.outcome else grpc.StatusCode.OK for s in batch]
    assert codes == [grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                     grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAUTHENTICATED,
                     grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.OK]
    assert batch[1].outcome is not None and batch[1].outcome.details == "prompt: must not be empty"
    assert batch[2].outcome is not None and "unknown model 'gpt-9'" in batch[2].outcome.details
    assert batch[7].resolved is not None and batch[7].resolved.model == "tiny-lm"


def test_one_batch_admits_exactly_the_burst_and_tells_the_rest_when_to_retry() -> None:
    rig = Rig()
    batch = [new_state(TIGHT_KEY, index=i) for i in range(10)]
    rig.pipeline.admit(batch)
    refused = [s.outcome for s in batch if s.outcome is not None]
    assert len(batch) - len(refused) == 4  # the tight tenant's burst
    assert all(stop.code == grpc.StatusCode.RESOURCE_EXHAUSTED for stop in refused)
    assert all(dict(stop.trailing)["retry-after"] for stop in refused)
    assert [s.outcome is None for s in batch] == [True] * 4 + [False] * 6  # arrival order wins


def test_a_hook_failure_fails_a_closed_stage_and_is_let_through_by_the_cache() -> None:
    cached = generation_pb2.GenerateRequest(model="tiny-lm", prompt=CACHED_PROMPT, max_tokens=4)
    router_down = Rig(hooks=[FaultHook(component="router", error_rate=1.0)])
    state = new_state(DEV_KEY, cached)
    router_down.pipeline.admit([state])
    assert state.outcome is not None and state.outcome.code == grpc.StatusCode.UNAVAILABLE
    assert "injected fault in router.Resolve" in state.outcome.details

    cache_down = Rig(hooks=[FaultHook(component="cache", error_rate=1.0)])
    state = new_state(DEV_KEY, cached)
    cache_down.pipeline.admit([state])
    assert state.outcome is None and state.hit is None  # a miss, not a failure
    assert cache_down.counted == [("cache", "UNAVAILABLE", "r0")] and state.failures == ["cache"]


def test_a_cache_that_fails_fails_open_for_every_request_of_its_batch() -> None:
    rig = Rig()

    def broken(items: Any, options: Any = None) -> Any:
        raise RuntimeError("device lost")

    rig.cache.lookup = broken  # type: ignore[method-assign]
    rig.placed.swap("cache", in_process(CACHE, rig.cache))
    batch = [new_state(DEV_KEY, index=i) for i in range(3)]
    rig.pipeline.admit(batch)
    assert all(s.outcome is None and s.hit is None and s.failures == ["cache"] for s in batch)
    assert [(name, reason) for name, reason, _ in rig.counted] == [("cache", "UNKNOWN")] * 3


def test_a_malformed_cache_item_fails_open_for_that_request_alone() -> None:
    rig = Rig()
    cached = generation_pb2.GenerateRequest(model="tiny-lm", prompt=CACHED_PROMPT, max_tokens=4)
    batch = [new_state(DEV_KEY, cached, index=i) for i in range(3)]
    rig.pipeline.admit(batch[:1])  # authenticated, then made malformed for the cache alone
    lookup = rig.cache.lookup

    def tenantless(items: list[Any], options: Any = None) -> Any:
        items[1] = ("", items[1][1])
        return lookup(items)

    rig.cache.lookup = tenantless  # type: ignore[method-assign]
    rig.placed.swap("cache", in_process(CACHE, rig.cache))
    rig.pipeline.admit(batch)
    assert [s.hit is not None for s in batch] == [True, False, True]
    assert [s.failures for s in batch] == [[], ["cache"], []]
    assert rig.counted == [("cache", "INVALID_ARGUMENT", "r1")]


def test_the_store_sends_back_the_key_the_lookup_made(tmp_path: Path) -> None:
    """Keyed once: the lookup returns the request's key, and the store files the answer
    under it without sending the request again."""
    rig = Rig(tmp_path)
    state = new_state(DEV_KEY, generation_pb2.GenerateRequest(model="tiny-lm", prompt="keyed once", max_tokens=4))
    rig.pipeline.admit([state])
    assert state.outcome is None and state.hit is None and len(state.cache_key) == 32
    sent: list[list[StoreItem]] = []
    store = rig.cache.store
    rig.cache.store = lambda items, options=None: (sent.append(list(items)), store(items))[1]  # type: ignore[method-assign]
    rig.placed.swap("cache", in_process(CACHE, rig.cache))
    rig.pipeline.complete([answered(state, "once")])
    assert [(item.key, item.request) for item in sent[0]] == [(state.cache_key, None)]
    again = new_state(DEV_KEY, state.request, index=1)
    rig.pipeline.admit([again])
    assert again.hit is not None and again.hit.text == "once" and again.hit.cached
    rig.close()


def test_a_bad_record_is_refused_alone_and_counted_and_the_good_ones_are_written(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    states = [answered(new_state(DEV_KEY, index=i)) for i in range(3)]
    for state in states:
        state.tenant = "dev"
    states[1].latency_s = float("nan")
    rig.pipeline.complete(states, [s for s in rig.pipeline.completion if s.name != "cache.store"])
    rig.close()
    assert [(name, reason) for name, reason, _ in rig.counted] == [("logs", "INVALID_ARGUMENT"),
                                                                   ("metrics", "INVALID_ARGUMENT")]
    assert states[1].failures == ["logs", "metrics"]
    text = rig.servicers["metrics"].render()
    assert sample(text, "spine_requests_total", tenant="dev", status="OK", shadow="false") == 2
    assert (tmp_path / "requests.jsonl").read_text().count("\n") == 2


def test_a_failed_log_append_is_counted_in_the_requests_metrics(tmp_path: Path) -> None:
    """Logs are written before metrics, so a request whose line could not be written says so
    in spine_middleware_failures_total."""
    rig = Rig(tmp_path, hooks=[FaultHook(component="logs", error_rate=1.0)])
    state = answered(new_state(DEV_KEY))
    rig.pipeline.complete([state])
    rig.close()
    assert state.failures == ["logs"]
    assert sample(rig.servicers["metrics"].render(), "spine_middleware_failures_total", middleware="logs") == 1


def deferred(rig: Rig, **kwargs: Any) -> DeferredCompletions:
    return DeferredCompletions(rig.pipeline, ALL_WRITES, **{"interval_s": 3600.0, **kwargs})


def counting_writes(rig: Rig) -> list[int]:
    writes: list[int] = []
    metrics = rig.servicers["metrics"]
    record = metrics.record
    metrics.record = lambda records, options=None: (writes.append(len(records)), record(records))[1]  # type: ignore[method-assign]
    rig.placed.swap("metrics", in_process(METRICS, metrics))
    return writes


def test_finished_requests_answer_at_once_and_are_written_a_window_at_a_time(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    writes = counting_writes(rig)
    completions = deferred(rig)  # the folder never fires here
    for i in range(3):
        completions.complete(answered(new_state(DEV_KEY, index=i)))
    assert writes == [] and completions.pending == 3  # answered, not yet written
    completions.drain()  # what a reader (a scrape, a flush) does first
    assert writes == [3] and completions.pending == 0
    assert sample(rig.servicers["metrics"].render(), "spine_requests_total", status="OK") == 3
    completions.complete(answered(new_state(DEV_KEY, index=3)))
    completions.close()  # shutdown: what is left is written
    completions.complete(answered(new_state(DEV_KEY, index=4)))  # a straggler after close: at once
    assert writes == [3, 1, 1]
    rig.close()
    assert (tmp_path / "requests.jsonl").read_text().count("\n") == 5


def test_a_response_handed_over_for_the_cache_is_stored_before_the_next_lookup(tmp_path: Path) -> None:
    """The spine stores answers off the request path, yet a repeated request still hits:
    a lookup stores what was handed over for the same request first (and only that)."""
    rig = Rig(tmp_path)
    completions = deferred(rig)
    request = generation_pb2.GenerateRequest(model="tiny-lm", prompt="store me later", max_tokens=4)
    first, second = new_state(DEV_KEY, request, index=1), new_state(DEV_KEY, request, index=2)
    rig.pipeline.admit([first, second])
    entries = len(rig.cache._index)
    completions.complete(answered(first, "old!"))
    completions.complete(answered(second, "wxyz"))  # handed over later: the one kept
    assert len(rig.cache._index) == entries  # handed over, not stored yet
    other = new_state(DEV_KEY, generation_pb2.GenerateRequest(model="tiny-lm", prompt="else", max_tokens=4))
    rig.pipeline.admit([other])
    assert len(rig.cache._index) == entries  # a lookup for another request stores nothing
    repeat = new_state(DEV_KEY, request, index=3)
    rig.pipeline.admit([repeat])
    assert repeat.hit is not None and repeat.hit.text == "wxyz"
    assert len(rig.cache._index) == entries + 1
    completions.close()
    rig.close()


class EnteredLock:
    """A lock that counts the threads that came to it, holding or waiting."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counting = threading.Lock()
        self.entered = 0

    def __enter__(self) -> EnteredLock:
        with self._counting:
            self.entered += 1
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_a_lookup_waits_for_a_store_another_thread_is_writing(tmp_path: Path) -> None:
    """The folder may have taken an answer off the queue and be storing it when a lookup
    for it arrives: the lookup must wait for that store, not find the queue empty and miss."""
    rig = Rig(tmp_path)
    completions = deferred(rig)
    store = rig.cache.store
    storing = threading.Event()
    lock = completions._store_lock = EnteredLock()  # type: ignore[assignment]  # who holds or waits for the store's turn

    def slow_store(items: Any, options: Any = None) -> Any:
        storing.set()  # the store holds the turn until the lookup below waits for it
        eventually(lambda: lock.entered >= 2, what="the lookup waiting for the store")
        return store(items)

    rig.cache.store = slow_store  # type: ignore[method-assign]
    rig.placed.swap("cache", in_process(CACHE, rig.cache))
    request = generation_pb2.GenerateRequest(model="tiny-lm", prompt="slow to store", max_tokens=4)
    state = new_state(DEV_KEY, request)
    rig.pipeline.admit([state])
    completions.complete(answered(state, "late"))
    writer = threading.Thread(target=completions.drain)
    writer.start()
    assert storing.wait(5)
    repeat = new_state(DEV_KEY, request, index=1)
    rig.pipeline.admit([repeat])
    writer.join()
    assert repeat.hit is not None and repeat.hit.text == "late"
    completions.close()
    rig.close()


def test_a_backlog_of_finished_requests_is_written_by_the_requests_themselves(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    completions = deferred(rig, max_batch=2)
    for i in range(40):
        completions.complete(answered(new_state(DEV_KEY, index=i)))
        assert completions.pending < 16  # 8 x max_batch: bounded memory, whoever writes
    completions.close()
    rig.close()
    assert (tmp_path / "requests.jsonl").read_text().count("\n") == 40  # every one written once


def test_the_completions_folder_writes_on_its_own_interval(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    completions = deferred(rig, interval_s=0.01)
    completions.complete(answered(new_state(DEV_KEY)))
    eventually(lambda: completions.pending == 0, what="the folder wrote on its own")
    assert completions.windows == 1
    completions.close()
    rig.close()


def test_stages_still_in_another_process_run_at_once_the_rest_later(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    writes = counting_writes(rig)
    completions = DeferredCompletions(rig.pipeline, ("logs.append",), interval_s=3600.0)
    completions.complete(answered(new_state(DEV_KEY)))
    assert writes == [1] and completions.pending == 1  # metrics now; the log line later
    completions.close()
    rig.close()
    assert (tmp_path / "requests.jsonl").read_text().count("\n") == 1


@pytest.mark.parametrize(("section", "message"), [
    ({"max_batch": 0}, "batching.max_batch"),
    ({"max_wait_us": -5}, "batching.max_wait_us"),
    ({"max_wait_us": 200_000}, r"batching.max_wait_us: Input should be less than or equal to 100000"),
    ({"completion_interval_ms": 0}, "batching.completion_interval_ms"),
    ({"enabled": "yes"}, "batching.enabled"),
    ({"remote": 1}, "batching.remote"),
    ({"window": 3}, "batching.window: unknown key"),
])
def test_bad_batching_config_names_the_field(section: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        BatchingConfig.parse(section, "batching")


def test_default_batching_config_is_the_documented_one() -> None:
    assert CONFIG.batching == BatchingConfig(enabled=True, remote=False, max_batch=32,
                                                                max_wait_us=10_000.0, completion_interval_ms=50.0)
