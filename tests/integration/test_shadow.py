"""Shadow mode: mirrors never change the answer, never spend budget or fill the cache,
are dropped when saturated, and mismatches (less calibrated noise) feed the parity gate
through the counters the mirror exports."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from migration.gates import Verdict, evaluate
from migration.metrics.scrape import ScrapeSource
from migration.plan import GateSpec
from migration.recording import HEALTHY
from migration.traffic.front import Front
from migration.traffic.front_target import FrontTarget
from runtime.running_stack import RunningStack
from runtime.server import RunningServer, start_server
from runtime.shadow.decisions import Decision, decide
from runtime.shadow.metrics import COMPARED, MISMATCHED, SKIPPED
from runtime.shadow.traffic import ShadowConfig, ShadowMirror
from services.common import ConfigError
from services.common.prometheus_http import PrometheusHTTPServer
from services.registry import GATEWAY
from spine.client.gateway_client import GatewayClient
from tests.conftest import DEV_KEY, TIGHT_KEY, config_for_tests, start_stack
from wire.v1 import generation_pb2

GREEDY = generation_pb2.GenerateRequest(model="tiny-lm", prompt="shadow me", max_tokens=3)
INTERNAL_SECRET = "shadow-test-internal-secret-0123456789"


def _decision(status: str = "OK", tokens: tuple[int, ...] | None = (1, 2), cached: bool = False) -> Decision:
    return Decision(status, "", "passed", "passed", "tiny-lm" if status == "OK" else "", cached, tokens)


def _never_called(*args: object) -> Decision:
    raise AssertionError("no mirror expected")


def test_a_mismatch_is_published_with_both_sides_and_counted_by_field(caplog: pytest.LogCaptureFixture) -> None:
    mirror = ShadowMirror(ShadowConfig(share=1.0, ignore_fields=()), _never_called, key=b"k" * 16)
    with caplog.at_level(logging.DEBUG, logger="spine.shadow"):
        found = mirror.compare("layered", "spine", _decision(tokens=(1, 2)), _decision(tokens=(1, 3)),
                               request_id="req-7")
    assert found is not None and found.fields == ("tokens",)
    # The WARNING line says where; the DEBUG line beside it holds both answers.
    warning, debug = ([r.getMessage() for r in caplog.records if r.levelno == level]
                      for level in (logging.WARNING, logging.DEBUG))
    assert warning == ["shadow mismatch on tokens: request req-7, tokens differ at position 1 "
                       "(layered 2 tokens, spine 2)"]
    assert len(debug) == 1 and "req-7" in debug[0] and "(1, 2)" in debug[0] and "(1, 3)" in debug[0]
    mirror.compare("spine", "layered", _decision(tokens=(1,), cached=False), _decision(tokens=(2,), cached=True))
    mirror.compare("layered", "spine", _decision(), _decision())
    # Comparing a layout with itself: counted apart, as calibration.
    mirror.compare("spine", "spine", _decision(cached=False), _decision(cached=True), calibration=True)
    counters = mirror.counters
    assert counters.value(COMPARED, calibration="false") == 3
    assert counters.value(COMPARED, primary="spine", shadow="layered") == 1
    assert counters.value(MISMATCHED, field="tokens", calibration="false") == 2  # one per pair that differed in it
    assert counters.value(MISMATCHED, field="cached", calibration="false") == 1
    assert counters.value(MISMATCHED, field="cached", calibration="true") == 1
    assert counters.value(COMPARED, calibration="true") == 1
    assert mirror.noisy_fields() == {"cached"}
    stats = mirror.stats()
    assert stats["counts"]["mismatched"] == 2 and stats["baseline_mismatch_rate"] == 1.0
    mirror.close()


def test_a_layout_failure_is_not_compared_but_counted_as_skipped() -> None:
    mirror = ShadowMirror(ShadowConfig(share=1.0), _never_called, key=b"k" * 16)
    assert mirror.compare("spine", "layered", _decision(status="UNAVAILABLE", tokens=None), _decision()) is None
    assert mirror.compare("spine", "spine", _decision(), _decision(status="DEADLINE_EXCEEDED", tokens=None),
                          calibration=True) is None
    # A refusal is an answer: compared like any other.
    assert mirror.compare("spine", "layered", _decision(status="NOT_FOUND", tokens=None), _decision()) is not None
    assert mirror.counters.value(SKIPPED, reason="layout_error") == 2
    assert mirror.counters.value(COMPARED) == 1 and mirror.noisy_fields() == frozenset()
    mirror.close()


def test_a_saturated_mirror_drops_instead_of_queueing() -> None:
    release = threading.Event()
    started = threading.Event()

    def slow(target: str, request: generation_pb2.GenerateRequest, metadata: object, timeout: float,
             stream: bool) -> Decision:
        started.set()
        release.wait(5)
        return _decision()

    mirror = ShadowMirror(ShadowConfig(share=1.0, calibration_share=0.0, max_in_flight=1), slow, key=b"k" * 16)
    try:
        assert mirror.offer("layered", GREEDY, (), _decision())
        assert started.wait(5)
        assert not mirror.offer("layered", GREEDY, (), _decision())
        assert mirror.counts["dropped"] == 1 and mirror.counts["mirrored"] == 1
        assert mirror.counters.value(SKIPPED, reason="saturated") == 1
    finally:
        release.set()
        assert mirror.wait_idle()
        mirror.close()
    assert mirror.counts["compared"] == 1 and mirror.counts.get("mismatched", 0) == 0


def test_unseeded_sampling_is_not_compared_token_by_token() -> None:
    sampled = generation_pb2.GenerateRequest(model="tiny-lm", prompt="p", max_tokens=3, temperature=0.8)
    a = decide(sampled, grpc.StatusCode.OK, response=generation_pb2.GenerateResponse(token_ids=[1], model="m"))
    b = decide(sampled, grpc.StatusCode.OK, response=generation_pb2.GenerateResponse(token_ids=[2], model="m"))
    assert a == b
    limited = decide(GREEDY, grpc.StatusCode.RESOURCE_EXHAUSTED, "rate limited by rps; retry after 0.125s")
    assert limited.ratelimit == "limited" and limited.details == "rate limited by rps; retry after <t>"


def test_shadow_settings_are_checked_and_name_the_field() -> None:
    assert ShadowConfig.parse({}) == ShadowConfig()
    assert ShadowConfig.parse({"share": 0.1, "ignore_fields": []}, "shadow").ignore_fields == ()
    with pytest.raises(ConfigError, match=r"shadow\.share.*1\.5"):
        ShadowConfig.parse({"share": 1.5}, "shadow")
    with pytest.raises(ConfigError, match=r"shadow\.max_in_flight.*0"):
        ShadowConfig.parse({"max_in_flight": 0}, "shadow")
    with pytest.raises(ConfigError, match=r"shadow\.ignore_fields.*colour"):
        ShadowConfig.parse({"ignore_fields": ["colour"]}, "shadow")
    with pytest.raises(ConfigError, match=r"shadow\.rate: unknown key; known: share"):
        ShadowConfig.parse({"rate": 1}, "shadow")


# -- the front in shadow mode, on two real layouts ----------------------------------------
@pytest.fixture(scope="module")
def sides(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RunningStack]]:
    tmp = tmp_path_factory.mktemp("shadow")
    config = config_for_tests(internal={"secret": INTERNAL_SECRET})
    stacks = {"layered": start_stack("collapsed", tmp / "a", config), "spine": start_stack("collapsed", tmp / "b", config)}
    try:
        yield stacks
    finally:
        for stack in stacks.values():
            stack.stop()


@pytest.fixture
def front(sides: dict[str, RunningStack]) -> Iterator[tuple[Front, RunningServer]]:
    front = Front({side: stack.address for side, stack in sides.items()},
                  shadow=ShadowConfig(share=1.0, calibration_share=0.0), rng=random.Random(3),
                  internal_key=INTERNAL_SECRET.encode())
    server = start_server([(GATEWAY, front)], "127.0.0.1:0")
    try:
        yield front, server
    finally:
        server.stop(0)
        front.close()


def test_shadows_spend_no_rate_limit_budget_and_write_no_cache(front: tuple[Front, RunningServer],
                                                               tmp_path: Path) -> None:
    the_front, server = front
    assert the_front.shadow is not None
    with GatewayClient(server.address) as client:
        # The tight tenant's burst is 4: four answers on the layered side, each mirrored to the spine.
        for index in range(4):
            request = generation_pb2.GenerateRequest(model="tiny-lm", prompt=f"tight {index}", max_tokens=2)
            result = client.generate(request, token=TIGHT_KEY, headers={"x-spine-route": "layered"})
            assert result.ok and result.trailing["x-spine-side"] == "layered"
        cached_first = client.generate(GREEDY, token=DEV_KEY, headers={"x-spine-route": "layered"})
        assert cached_first.ok
        assert the_front.shadow.wait_idle()
        assert the_front.shadow.counts["mirrored"] == 5
        # The spine side still has the whole budget, and never cached the mirrored answer.
        for index in range(4):
            request = generation_pb2.GenerateRequest(model="tiny-lm", prompt=f"tight {index}", max_tokens=2)
            assert client.generate(request, token=TIGHT_KEY, headers={"x-spine-route": "spine"}).ok
        on_spine = client.generate(GREEDY, token=DEV_KEY, headers={"x-spine-route": "spine"})
        assert on_spine.ok and on_spine.response is not None and not on_spine.response.cached
        assert the_front.shadow.wait_idle()
    assert the_front.shadow.counts["compared"] == 10
    # Mirrors of the spine's tight requests found the layered bucket spent (by its own
    # primaries only) — published as rate-limit mismatches; every other answer agreed
    # (the cache-hit difference on the last request is ignored by the default config).
    mismatches = list(the_front.shadow.mismatches)
    assert len(mismatches) == 4
    assert the_front.shadow.counters.value(MISMATCHED, field="ratelimit", primary="spine", shadow="layered") == 4
    assert all(m.primary_side == "spine" and "ratelimit" in m.fields and m.shadow.ratelimit == "limited"
               for m in mismatches)


def test_the_front_exports_its_comparisons_and_the_parity_gate_reads_them_there(
        front: tuple[Front, RunningServer], sides: dict[str, RunningStack]) -> None:
    the_front, _ = front
    assert the_front.shadow is not None
    endpoint = PrometheusHTTPServer(the_front.shadow.counters.registry)
    endpoint.start()
    source = ScrapeSource({"front": [f"http://{endpoint.address}/metrics"]}, interval_s=None)
    target = FrontTarget(the_front, sides["spine"], parity=source)
    try:
        assert target.shadow().enabled
        start = time.time()
        time.sleep(0.01)
        assert target.window_stats(start)[2].compared == 0  # nothing compared in this window yet
        the_front.shadow.compare("layered", "spine", _decision(tokens=(1,)), _decision(tokens=(2,)))
        the_front.shadow.compare("spine", "layered", _decision(), _decision())
        parity = target.window_stats(start)[2]
        assert (parity.compared, parity.mismatches, dict(parity.by_field)) == (2, 1, {"tokens": 1})
        assert evaluate([GateSpec("parity", 0)], HEALTHY, HEALTHY, parity, 1)[0].verdict is Verdict.FAIL
    finally:
        target.close()
        endpoint.stop()


def test_a_front_without_shadow_says_so(sides: dict[str, RunningStack]) -> None:
    front = Front({"layered": "127.0.0.1:1", "spine": "127.0.0.1:1"})
    try:
        capability = FrontTarget(front, sides["spine"]).shadow()
        assert not capability.enabled and "shadow.share" in capability.detail
    finally:
        front.close()


def test_calibration_compares_a_layout_with_itself_and_learns_its_noise(sides: dict[str, RunningStack]) -> None:
    front = Front({side: stack.address for side, stack in sides.items()},
                  shadow=ShadowConfig(share=1.0, calibration_share=1.0, ignore_fields=()), rng=random.Random(5),
                  internal_key=INTERNAL_SECRET.encode())
    server = start_server([(GATEWAY, front)], "127.0.0.1:0")
    try:
        assert front.shadow is not None
        with GatewayClient(server.address, DEV_KEY) as client:
            request = generation_pb2.GenerateRequest(model="tiny-lm", prompt="calibrate", max_tokens=2)
            assert client.generate(request, headers={"x-spine-route": "spine"}).ok
            assert front.shadow.wait_idle()
    finally:
        server.stop(0)
        front.close()
    # The mirror went back to the spine itself, after the primary had filled its cache:
    # the same layout answers from cache the second time, so `cached` is noise.
    assert front.shadow.counts["calibration_compared"] == 1 and front.shadow.counts.get("compared", 0) == 0
    assert front.shadow.noisy_fields() == {"cached"}
    counters = front.shadow.counters
    assert counters.value(MISMATCHED, field="cached", calibration="true", primary="spine", shadow="spine") == 1
    assert counters.value(MISMATCHED, calibration="false") == 0
