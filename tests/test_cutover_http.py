"""The migration covers HTTP: the front splits HTTP traffic by the stage's weight (sticky, with
the same header override as gRPC), mirrors and compares HTTP answers, counts layout failures
(5xx) but not refusals (4xx), and the xDS snapshot routes an HTTP listener between the sides'
HTTP APIs by the same weights."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.route.v3 import route_pb2

from migration.traffic.cutover import Cutover
from migration.xds.snapshot import ENDPOINT, ROUTE
from tests.conftest import DEV_KEY, config_for_tests

UNLIMITED_DEV = {"ratelimit": {"tenants": {"dev": {"requests_per_second": 1_000_000, "burst": 1_000_000}}}}


@pytest.fixture(scope="module")
def cutover(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cutover]:
    config = config_for_tests(shadow={"share": 1.0},
                              calls={"budgets_ms": dict.fromkeys(("auth", "ratelimit", "router", "cache"), 2000)},
                              **UNLIMITED_DEV)
    rig = Cutover(config, Path(tmp_path_factory.mktemp("cutover-http")), xds_listen="127.0.0.1:0",
                  http_listen="127.0.0.1:0")
    rig.start()
    try:
        yield rig
    finally:
        rig.stop()


def post(cutover: Cutover, prompt: str, **headers: str) -> httpx.Response:
    with httpx.Client(base_url=f"http://{cutover.http_address}", timeout=10) as client:
        return client.post("/v1/chat/completions", headers={"authorization": f"Bearer {DEV_KEY}", **headers},
                           json={"model": "tiny-lm", "max_tokens": 3, "temperature": 0,
                                 "messages": [{"role": "user", "content": prompt}]})


def test_http_through_the_front_follows_the_weight_the_header_and_the_session(cutover: Cutover) -> None:
    assert cutover.front is not None
    cutover.front.set_weight(0)
    assert {post(cutover, f"w0 {i}").headers["x-spine-side"] for i in range(6)} == {"layered"}
    cutover.front.set_weight(100)
    assert {post(cutover, f"w100 {i}").headers["x-spine-side"] for i in range(6)} == {"spine"}
    cutover.front.set_weight(50)
    forced = post(cutover, "forced", **{"x-spine-route": "layered"})
    assert forced.status_code == 200 and forced.headers["x-spine-side"] == "layered"
    assert forced.headers["x-spine-layout"] == "layered"  # the side's own gateway answered
    sides = {post(cutover, f"sticky {i}", **{"x-session-id": "one-conversation"}).headers["x-spine-side"]
             for i in range(6)}
    assert len(sides) == 1
    spread = {post(cutover, f"spread {i}", **{"x-session-id": f"conversation-{i}"}).headers["x-spine-side"]
              for i in range(24)}
    assert spread == {"layered", "spine"}


def test_the_sdk_through_the_front_and_its_answers_mirrored_and_compared(cutover: Cutover) -> None:
    assert cutover.front is not None and cutover.front.shadow is not None
    cutover.front.set_weight(50)
    before = dict(cutover.front.shadow.stats()["counts"])
    client = openai.OpenAI(base_url=f"http://{cutover.http_address}/v1", api_key=DEV_KEY, max_retries=0)
    for i in range(6):
        plain = client.chat.completions.create(model="tiny-lm", max_tokens=3, temperature=0,
                                               messages=[{"role": "user", "content": f"mirrored {i}"}])
        assert plain.choices[0].message.content is not None
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
            model="tiny-lm", max_tokens=3, temperature=0, stream=True,
            messages=[{"role": "user", "content": f"mirrored stream {i}"}]) if chunk.choices)
        assert streamed
    assert cutover.front.shadow.wait_idle(10)
    after = cutover.front.shadow.stats()["counts"]
    def compared(counts: dict[str, int]) -> int:  # against the other side, or (calibration) its own
        return counts.get("compared", 0) + counts.get("calibration_compared", 0)

    assert compared(after) - compared(before) >= 12
    assert after.get("mismatched", 0) == before.get("mismatched", 0)


def test_refusals_over_http_are_not_layout_failures(cutover: Cutover) -> None:
    assert cutover.front is not None
    since = time.time()
    assert post(cutover, "fine").status_code == 200
    with httpx.Client(base_url=f"http://{cutover.http_address}", timeout=10) as client:
        denied = client.post("/v1/chat/completions", headers={"authorization": "Bearer nope"},
                             json={"model": "tiny-lm", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
    assert denied.status_code == 401
    window = cutover.front.window(since)
    assert sum(side.requests for side in window.values()) >= 2
    assert sum(side.errors for side in window.values()) == 0


def test_xds_routes_the_http_listener_by_the_same_weights(cutover: Cutover) -> None:
    assert cutover.xds is not None and cutover.spine is not None and cutover.layered is not None
    snapshot = cutover.xds.set_spine_percent(25.0, "http-stage")
    route = snapshot.of_type(ROUTE)["spine-gateway-http-route"]
    assert isinstance(route, route_pb2.RouteConfiguration)
    weighted = route.virtual_hosts[0].routes[-1].route.weighted_clusters.clusters
    assert {c.name: c.weight.value for c in weighted} == {"layered-http": 7500, "spine-http": 2500}
    grpc_route = snapshot.of_type(ROUTE)["spine-gateway-route"]
    assert [c.weight.value for c in grpc_route.virtual_hosts[0].routes[-1].route.weighted_clusters.clusters] == \
        [c.weight.value for c in weighted]
    for side, stack in (("layered", cutover.layered), ("spine", cutover.spine)):
        assignment = snapshot.of_type(ENDPOINT)[f"{side}-http"]
        assert isinstance(assignment, endpoint_pb2.ClusterLoadAssignment)
        address = assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address
        assert f"{address.address}:{address.port_value}" == stack.http_address
