"""Nothing a client sends switches on internal behaviour: one test per `x-spine-*` header.

- `x-spine-shadow` (shadow copies: rate limit dry run, no cache write) is honoured only when
  it is the front's signed mark for that request; a client's "1", a mark signed with another
  key, or an old one changes nothing, in either layout.
- `x-spine-route` (forcing a side) is an operator's tool the front can turn off, and does
  so when the running plan says `route_header: false`.
- The front passes no `x-spine-*` key from a client on to a side.
- A client's `traceparent` cannot switch tracing on (it is a link, not a parent).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from migration.controller import Controller
from migration.plan import load_plan
from migration.traffic.front import Front
from migration.traffic.front_target import FrontTarget
from runtime.config.file import placements_for
from runtime.observability.tracing import Tracing, installed_tracing
from runtime.running_stack import RunningStack
from runtime.server import start_server
from runtime.stack import Stack
from services.pipeline.internal_marks import SHADOW_HEADER, is_shadow, shadow_mark
from services.registry import GATEWAY
from spine.client.gateway_client import GatewayClient
from tests.conftest import DEV_KEY, TEST_OVERRIDES, TIGHT_KEY, config_for_tests, start_stack
from wire.v1 import generation_pb2

SECRET = "internal-metadata-test-secret-0123456789"
KEY = SECRET.encode()
# A second tight tenant for the HTTP test: its burst is its own, whatever ran before it.
HTTP_TIGHT_KEY = "tight-http-tenant-key-0000"
CONFIG = config_for_tests(
    internal={"secret": SECRET},
    auth={"api_keys": [*TEST_OVERRIDES["auth"]["api_keys"],
                       {"id": "tight-http", "tenant": "tight-http", "key": HTTP_TIGHT_KEY, "scopes": ["generate"]}]},
    ratelimit={"tenants": {**TEST_OVERRIDES["ratelimit"]["tenants"],
                           "tight-http": TEST_OVERRIDES["ratelimit"]["tenants"]["tight"]}})


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RunningStack]]:
    tmp = tmp_path_factory.mktemp("internal")
    started: dict[str, RunningStack] = {}
    try:
        for layout in ("collapsed", "layered"):
            # with the HTTP API too: the mark reaches the pipeline from HTTP headers as well
            started[layout] = Stack(CONFIG, placements_for(layout, CONFIG), run_dir=tmp / layout,
                                    http_listen="127.0.0.1:0").start()
        yield started
    finally:
        for stack in started.values():
            stack.stop()


def tight(client: GatewayClient, n: int, headers: dict[str, str] | None = None,
          request_id: str | None = None) -> list[grpc.StatusCode]:
    codes = []
    for i in range(n):
        request = generation_pb2.GenerateRequest(model="tiny-lm", prompt=f"tight {time.time()} {i}", max_tokens=2)
        extra = dict(headers or {})
        if request_id is not None:
            extra["x-request-id"] = f"{request_id}-{i}"
            extra[SHADOW_HEADER] = shadow_mark(KEY, extra["x-request-id"])
        codes.append(client.generate(request, token=TIGHT_KEY, headers=extra).code)
    return codes


@pytest.mark.parametrize("layout", ["collapsed", "layered"])
def test_only_the_fronts_signed_mark_makes_a_request_shadow(stacks: dict[str, RunningStack], layout: str) -> None:
    """The tight tenant's burst is 4 (refilling about once in 17 minutes)."""
    with GatewayClient(stacks[layout].address) as client:
        # Signed shadow copies are decided as dry runs: they never spend the burst.
        assert tight(client, 6, request_id=f"signed-{layout}") == [grpc.StatusCode.OK] * 6
        forged = {"1": {SHADOW_HEADER: "1"},
                  "true": {SHADOW_HEADER: "true"},
                  "another key": {"x-request-id": "forged", SHADOW_HEADER: shadow_mark(b"not the secret", "forged")},
                  "stale": {"x-request-id": "stale", SHADOW_HEADER: shadow_mark(KEY, "stale", now=time.time() - 3600)}}
        codes = [tight(client, 1, headers)[0] for headers in forged.values()] + tight(client, 2)
    assert codes == [grpc.StatusCode.OK] * 4 + [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2


def test_over_http_too_only_the_signed_mark_makes_a_request_shadow(stacks: dict[str, RunningStack]) -> None:
    """The HTTP front marks its copies to the spine; the HTTP API passes the mark on, and the
    gateway honours it only when it verifies: a client's forgery is charged like any request."""
    def post(client: httpx.Client, i: int, headers: dict[str, str]) -> int:
        body = {"model": "tiny-lm", "max_tokens": 2, "messages": [{"role": "user", "content": f"http {time.time()} {i}"}]}
        return client.post("/v1/chat/completions", json=body,
                           headers={"authorization": f"Bearer {HTTP_TIGHT_KEY}", **headers}).status_code

    with httpx.Client(base_url=f"http://{stacks['collapsed'].http_address}", timeout=10) as client:
        signed = [post(client, i, {"x-request-id": f"http-signed-{i}",
                                   SHADOW_HEADER: shadow_mark(KEY, f"http-signed-{i}")}) for i in range(6)]
        forged = [post(client, 10 + i, headers) for i, headers in enumerate((
            {SHADOW_HEADER: "1"}, {"x-request-id": "http-forged", SHADOW_HEADER: shadow_mark(b"nope", "http-forged")},
            {"x-request-id": "http-stale", SHADOW_HEADER: shadow_mark(KEY, "http-stale", now=time.time() - 3600)}))]
        plain = [post(client, 20 + i, {}) for i in range(2)]
    assert signed == [200] * 6  # dry runs: the burst of 4 untouched
    assert forged + plain == [200, 200, 200, 200, 429]  # forgeries are charged like any request


def test_a_mark_is_bound_to_its_request_id_and_its_time() -> None:
    mark = shadow_mark(KEY, "r1", now=1000.0)
    assert is_shadow(KEY, mark, "r1", now=1010.0)
    assert not is_shadow(KEY, mark, "r2", now=1010.0)
    assert not is_shadow(KEY, mark, "r1", now=1100.0)
    assert not is_shadow(None, mark, "r1", now=1010.0)
    assert not is_shadow(KEY, "1", "r1") and not is_shadow(KEY, "", "r1") and not is_shadow(KEY, "9" * 40, "r1")


@pytest.fixture(scope="module")
def sides(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RunningStack]]:
    tmp = tmp_path_factory.mktemp("front-sides")
    started = {"layered": start_stack("collapsed", tmp / "a", CONFIG), "spine": start_stack("collapsed", tmp / "b", CONFIG)}
    try:
        yield started
    finally:
        for stack in started.values():
            stack.stop()


def serve_front(front: Front) -> Iterator[str]:
    server = start_server([(GATEWAY, front)], "127.0.0.1:0")
    try:
        yield server.address
    finally:
        server.stop(0)
        front.close()


def test_the_route_header_is_ignored_when_the_front_turns_it_off(sides: dict[str, RunningStack]) -> None:
    addresses = {side: stack.address for side, stack in sides.items()}
    for route_header, expected in ((True, {"spine"}), (False, {"layered"})):
        front = Front(addresses, spine_weight=0.0, route_header=route_header, rng=random.Random(1))
        for address in serve_front(front):
            with GatewayClient(address, DEV_KEY) as client:
                seen = {client.generate(generation_pb2.GenerateRequest(model="tiny-lm", prompt=f"r{i}", max_tokens=1),
                                        headers={"x-spine-route": "spine"}).trailing["x-spine-side"]
                        for i in range(3)}
        assert seen == expected


ALL_LOCAL_PLAN = """\
name: all-spine
route_header: {route_header}
stages:
  - name: all
    spine_weight: 100
    placements: {{logs: local, metrics: local, cache: local, router: local, ratelimit: local, auth: local}}
    hold_s: 600
"""


@pytest.mark.parametrize("route_header", [False, True])
def test_the_front_honours_the_route_header_as_the_running_plan_says(sides: dict[str, RunningStack], tmp_path: Path,
                                                                     route_header: bool) -> None:
    """A real controller starts a plan at 100% spine on the built-in front (constructed with the
    opposite setting): `x-spine-route: layered` reaches the layered side only if the plan allows it."""
    front = Front({side: stack.address for side, stack in sides.items()}, route_header=not route_header,
                  rng=random.Random(1))
    controller = Controller.open(str(tmp_path / "rollout.db"), FrontTarget(front, sides["spine"]))
    try:
        controller.start(load_plan(ALL_LOCAL_PLAN.format(route_header=str(route_header).lower())), "test")
        assert front.route_header is route_header and front.spine_weight == 100
        for address in serve_front(front):
            with GatewayClient(address, DEV_KEY) as client:
                seen = {client.generate(generation_pb2.GenerateRequest(model="tiny-lm", prompt=f"p{i}", max_tokens=1),
                                        headers={"x-spine-route": "layered"}).trailing["x-spine-side"]
                        for i in range(3)}
        assert seen == ({"layered"} if route_header else {"spine"})
    finally:
        controller.close()


def test_the_front_passes_no_internal_header_from_a_client_to_a_side(sides: dict[str, RunningStack]) -> None:
    front = Front({side: stack.address for side, stack in sides.items()}, spine_weight=0.0, internal_key=KEY)
    for address in serve_front(front):
        with GatewayClient(address) as client:
            # A mark the client could have seen (the right key, a fresh stamp) is still not passed on.
            codes = [client.generate(generation_pb2.GenerateRequest(model="tiny-lm", prompt=f"f{i}", max_tokens=1),
                                     token=TIGHT_KEY,
                                     headers={"x-request-id": f"via-front-{i}",
                                              SHADOW_HEADER: shadow_mark(KEY, f"via-front-{i}")}).code
                     for i in range(6)]
    assert codes == [grpc.StatusCode.OK] * 4 + [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2


def test_a_clients_sampled_traceparent_does_not_switch_tracing_on(tmp_path: Path) -> None:
    exporter = InMemorySpanExporter()
    with installed_tracing(Tracing(sample_ratio=0.0, exporters=[exporter], batch=False)):
        stack = start_stack("collapsed", tmp_path, CONFIG)
        try:
            with GatewayClient(stack.address, DEV_KEY) as client:
                sampled = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
                request = generation_pb2.GenerateRequest(model="tiny-lm", prompt="trace me?", max_tokens=1)
                assert client.generate(request, headers={"traceparent": sampled}).ok
        finally:
            stack.stop()
    assert exporter.get_finished_spans() == ()
