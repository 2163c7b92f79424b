"""Scientist inside the spine: where Envoy splits traffic, the spine mirrors a share of its
own answers to the layered side, exports the comparisons on its /metrics, and the parity
gate reads them through both metrics sources — a direct scrape and a real Prometheus.

Two real stacks stand in for the sides (the layered side a collapsed stack, as in
`test_migration_xds_target`: what matters here is that it is another gateway sharing the
internal secret). The spine's model sits behind the demo's parity fault (`WrongAnswers`):
switched on, the spine answers greedy requests differently while every call succeeds.
"""

from __future__ import annotations

import itertools
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from migration.controller import Controller
from migration.gates import Verdict, evaluate
from migration.metrics.promql import PrometheusSource
from migration.metrics.scrape import ScrapeSource
from migration.plan import GateSpec, PlanError, load_plan
from migration.traffic.xds_target import XdsTarget
from migration.xds import Endpoint, XdsControlPlane
from monolith.device import DeviceContext
from runtime.config.file import placements_for
from runtime.faults import FaultHook, WrongAnswers
from runtime.running_stack import RunningStack
from runtime.shadow.metrics import COMPARED, MISMATCHED
from runtime.stack import Stack
from services.common import ConfigError
from services.registry import DEFAULT
from spine.client.gateway_client import GatewayClient
from tests.conftest import DEV_KEY, config_for_tests
from tests.prometheus_server import run_prometheus
from wire.v1 import generation_pb2

SECRET = "gateway-mirror-test-internal-secret-0123"
PROMPTS = (f"mirror prompt {n}" for n in itertools.count())
PARITY_PLAN = """
name: parity
window_s: 1
stages:
  - name: canary
    spine_weight: 5
    hold_s: 1
    gates:
      - {type: error_rate, max_delta: 0.01}
      - {type: parity, max_mismatches: 0}
"""


@dataclass
class Sides:
    layered: RunningStack
    spine: RunningStack
    fault: FaultHook

    def metrics_url(self, side: str) -> str:
        return f"http://{getattr(self, side).metrics_address()}/metrics"


@pytest.fixture(scope="module")
def sides(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sides]:
    tmp = tmp_path_factory.mktemp("gateway-mirror")
    base = config_for_tests(internal={"secret": SECRET})
    layered = Stack(base, placements_for("collapsed", base), run_dir=tmp / "layered").start()
    spine: RunningStack | None = None
    try:
        config = base.with_overrides({"shadow": {"share": 1.0, "calibration_share": 0.0,
                                                 "layered_address": layered.address}})
        fault = FaultHook()
        device = DeviceContext.for_section(config.device)
        model = WrongAnswers(DEFAULT["inference"].build(config, device, tmp), fault)
        spine = Stack(config, placements_for("collapsed", config), run_dir=tmp / "spine", device=device,
                      servicers={"inference": model}).start()
        yield Sides(layered, spine, fault)
    finally:
        for stack in (spine, layered):
            if stack is not None:
                stack.stop()


def send_to_spine(sides: Sides, count: int, token: str = DEV_KEY) -> None:
    """`count` greedy requests with new prompts, answered by the spine; then every copy compared."""
    with GatewayClient(sides.spine.address, token) as client:
        for _ in range(count):
            client.generate(generation_pb2.GenerateRequest(model="tiny-lm", prompt=next(PROMPTS), max_tokens=4))
    assert sides.spine.shadow is not None and sides.spine.shadow.mirror.wait_idle()


def scraped(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return sum(value for (sample, pairs), value in samples.items()
               if sample == name and all(dict(pairs).get(k) == v for k, v in labels.items()))


def test_the_spine_exports_its_comparisons_with_the_layered_side_on_its_metrics(sides: Sides) -> None:
    url = sides.metrics_url("spine")
    before = scraped(url)
    assert total(before, COMPARED, primary="spine", shadow="layered") >= 0  # exported from the start
    send_to_spine(sides, 5)
    send_to_spine(sides, 2, token="not-a-valid-key")  # refusals are answers too: both sides refuse alike
    agreeing = scraped(url)
    cross = {"primary": "spine", "shadow": "layered", "calibration": "false"}
    assert total(agreeing, COMPARED, **cross) - total(before, COMPARED, **cross) == 7
    assert total(agreeing, MISMATCHED) == total(before, MISMATCHED)
    sides.fault.wrong_answers = True
    try:
        send_to_spine(sides, 4)
    finally:
        sides.fault.clear()
    after = scraped(url)
    assert total(after, COMPARED, **cross) - total(agreeing, COMPARED, **cross) == 4
    assert total(after, MISMATCHED, field="tokens", **cross) - total(agreeing, MISMATCHED, field="tokens", **cross) == 4
    assert {dict(pairs)["field"] for (name, pairs) in after if name == MISMATCHED} == {"tokens"}
    # The layered side served the copies as shadow traffic: counted apart from its own requests.
    layered = scraped(sides.metrics_url("layered"))
    assert total(layered, "spine_requests_total", shadow="true") >= 11


def test_the_parity_gate_reads_the_spines_comparisons_through_a_direct_scrape(sides: Sides) -> None:
    source = ScrapeSource({"layered": [sides.metrics_url("layered")], "spine": [sides.metrics_url("spine")]},
                          interval_s=None)
    target = XdsTarget(XdsControlPlane("spine-gateway", {"layered": [], "spine": []}), source)
    try:
        capability = target.shadow()
        assert capability.enabled and sides.metrics_url("spine") in capability.detail
        since = time.time()
        send_to_spine(sides, 3)
        assert judge(target, since) == (Verdict.PASS, 3, 0)
        since = time.time()
        sides.fault.wrong_answers = True
        try:
            send_to_spine(sides, 3)
        finally:
            sides.fault.clear()
        assert judge(target, since) == (Verdict.FAIL, 3, 3)
    finally:
        target.close()


def judge(target: XdsTarget, since: float) -> tuple[Verdict, int, int]:
    _, spine, parity = target.window_stats(since)
    result = evaluate([GateSpec("parity", 0)], spine, spine, parity, 1)[0]
    return result.verdict, parity.compared, parity.mismatches


def test_the_parity_gate_reads_the_spines_comparisons_through_promql(sides: Sides, tmp_path: Path) -> None:
    jobs = {"layered": [sides.layered.metrics_address()], "spine": [sides.spine.metrics_address()]}
    with run_prometheus(tmp_path / "prometheus", jobs) as prometheus:
        source = PrometheusSource(prometheus.url, {"layered": 'job="layered"', "spine": 'job="spine"'})
        prometheus.wait_scraped(time.time(), 2)
        assert source.shadow_exported().enabled
        for wrong, verdict in ((False, Verdict.PASS), (True, Verdict.FAIL)):
            since = prometheus.wait_scraped(time.time(), 2)
            prometheus.wait_scraped(since, 2)  # a sample of every target between the window's start and the traffic
            sides.fault.wrong_answers = wrong
            try:
                send_to_spine(sides, 4)
            finally:
                sides.fault.clear()
            until = prometheus.wait_scraped(prometheus.wait_scraped(time.time(), 2), 2)
            parity = source.parity(since, until)
            spine = source.window("spine", since, until)
            result = evaluate([GateSpec("parity", 0)], spine, spine, parity, 1)[0]
            # increase() extrapolates a series older than the window to its edges: at least the count.
            assert result.verdict is verdict and parity.compared >= 4, (result, parity)
            assert (parity.mismatches >= 4) if wrong else parity.mismatches == 0, parity


def test_a_parity_plan_is_refused_where_no_spine_exports_comparisons(sides: Sides, tmp_path: Path) -> None:
    """The layered side mirrors nothing: read alone, the source finds no comparisons."""
    layered_only = ScrapeSource({"layered": [sides.metrics_url("layered")], "spine": [sides.metrics_url("layered")]},
                                interval_s=None)
    plane = XdsControlPlane("spine-gateway", {"layered": [Endpoint("127.0.0.1", 1)], "spine": []})
    controller = Controller.open(str(tmp_path / "m.db"), XdsTarget(plane, layered_only))
    try:
        with pytest.raises(PlanError, match="exports spine_shadow_compared_total") as refused:
            controller.start(load_plan(PARITY_PLAN), "test")
        assert "stages[0].gates[1] (line 10): parity gate with no shadow comparisons to read" in refused.value.problems
    finally:
        controller.close()
        layered_only.close()


def test_a_spine_that_mirrors_needs_the_internal_secret_and_its_own_metrics(tmp_path: Path) -> None:
    shadow = {"share": 0.5, "layered_address": "127.0.0.1:1"}
    no_secret = config_for_tests(shadow=shadow)
    with pytest.raises(ConfigError, match="needs the deployment's internal secret"):
        Stack(no_secret, placements_for("collapsed", no_secret), run_dir=tmp_path / "a").start()
    remote_metrics = config_for_tests(shadow=shadow, internal={"secret": SECRET})
    placements = placements_for("collapsed", remote_metrics) | {"metrics": "remote"}
    with pytest.raises(ConfigError, match="placements.metrics: local"):
        Stack(remote_metrics, placements, run_dir=tmp_path / "b").start()
