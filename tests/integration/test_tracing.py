"""Spans with the same names and the same tree in every layout; trace context over gRPC."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from monolith.device import DeviceContext
from runtime.config.file import placements_for
from runtime.loop_server import start_loop_server
from runtime.observability.tracing import ROOT_SPAN, Tracing, TracingConfig, installed_tracing
from runtime.placement.remote import remote
from runtime.server import start_server
from runtime.stack import Stack
from services.common import ConfigError
from services.pipeline.batch_rpc import ItemError
from services.pipeline.interface import CallOptions
from services.registry import DEFAULT
from services.router.api import ROUTER
from spine.client.gateway_client import GatewayClient
from tests.conftest import DEV_KEY, config_for_tests
from wire.v1 import generation_pb2

MIDDLEWARE_SPANS = {"auth.check", "router.resolve", "ratelimit.admit", "cache.lookup", "text_completion tiny-lm",
                    "ratelimit.release", "cache.store", "metrics.record", "logs.append"}


def _tree(spans: Sequence[ReadableSpan]) -> tuple[str, tuple[Any, ...]]:
    """(name, sorted children) of the one root among `spans`."""
    by_parent: dict[int | None, list[ReadableSpan]] = {}
    for span in spans:
        parent = span.parent.span_id if span.parent is not None else None
        by_parent.setdefault(parent, []).append(span)

    def shape(span: ReadableSpan) -> tuple[str, tuple[Any, ...]]:
        children = by_parent.get(span.context.span_id, []) if span.context is not None else []
        return (span.name, tuple(sorted(shape(child) for child in children)))

    roots = by_parent.get(None, [])
    assert len(roots) == 1, [s.name for s in roots]
    return shape(roots[0])


def _one_request_spans(layout: str, tmp: Path, batching: bool = False) -> list[ReadableSpan]:
    exporter = InMemorySpanExporter()
    tracing = Tracing(sample_ratio=1.0, exporters=[exporter], batch=False)
    config = config_for_tests(batching={"enabled": batching})
    with installed_tracing(tracing):
        # the installed tracer hooks itself into the stack's pipeline (batch steps and the model's call)
        stack = Stack(config, placements_for(layout, config), run_dir=tmp / f"{layout}-{batching}").start()
        try:
            with GatewayClient(stack.address, DEV_KEY) as client:
                request = generation_pb2.GenerateRequest(model="tiny-lm", prompt="trace me", max_tokens=3)
                assert client.generate(request).ok
        finally:
            stack.stop()
    spans = [s for s in exporter.get_finished_spans()]
    roots = [s for s in spans if s.name == ROOT_SPAN]
    assert len(roots) == 1
    trace_id = roots[0].context.trace_id if roots[0].context is not None else None
    return [s for s in spans if s.context is not None and s.context.trace_id == trace_id]


@pytest.mark.parametrize("batching", [False, True])
def test_span_trees_of_the_layered_and_collapsed_layouts_have_the_same_shape(tmp_path: Path, batching: bool) -> None:
    layered = _tree(_one_request_spans("layered", tmp_path))
    collapsed = _tree(_one_request_spans("collapsed", tmp_path, batching=batching))
    assert layered == collapsed
    name, children = collapsed
    assert name == ROOT_SPAN
    assert {child[0] for child in children} == MIDDLEWARE_SPANS
    genai = next(child for child in children if child[0] == "text_completion tiny-lm")  # the GenAI span
    assert [grandchild[0] for grandchild in genai[1]] == ["inference.generate"]  # over the model's rpc


@pytest.mark.parametrize("start", [start_server, start_loop_server], ids=["thread-pool", "event-loop"])
def test_trace_context_crosses_a_grpc_hop_into_the_servers_span(tmp_path: Path, start: Any) -> None:
    exporter = InMemorySpanExporter()
    tracing = Tracing(sample_ratio=1.0, exporters=[exporter], batch=False)
    servicer = DEFAULT["router"].build(config_for_tests(), DeviceContext(), tmp_path)
    server = start([(DEFAULT["router"], servicer)], f"unix:{tmp_path / 'router.sock'}",
                   interceptors=[tracing.server_interceptor()])
    channel = grpc.insecure_channel(server.address)
    router = remote(ROUTER, DEFAULT["router"].stub_class()(channel), channel)
    hook = tracing.hook("layered")
    try:
        with tracing.tracer.start_as_current_span("caller"):
            metadata: list[tuple[str, str]] = []
            token = hook.begin("router", "Resolve", metadata)  # as the pipeline runs its hooks
            [route] = router.resolve(["tiny"], CallOptions(5, tuple(metadata)))
            hook.end(token, grpc.StatusCode.OK)
            assert not isinstance(route, ItemError) and route.model_id == "tiny-lm"
    finally:
        channel.close()
        server.stop(0)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    client, served, caller = spans["router.resolve"], spans["spine.v1.Router/ResolveBatch"], spans["caller"]
    assert client.parent is not None and caller.context is not None and client.parent.span_id == caller.context.span_id
    assert served.parent is not None and client.context is not None
    assert served.parent.span_id == client.context.span_id
    assert served.context is not None and served.context.trace_id == caller.context.trace_id
    assert client.attributes is not None and client.attributes["spine.layout"] == "layered"


def test_a_traceparent_in_the_metadata_names_the_parent_for_work_on_another_thread() -> None:
    exporter = InMemorySpanExporter()
    tracing = Tracing(sample_ratio=1.0, exporters=[exporter], batch=False)
    hook = tracing.hook()
    with tracing.tracer.start_as_current_span("request") as request_span:
        from runtime.observability.tracing import current_traceparent

        handed_over = list(current_traceparent())
    metadata = [("x-request-id", "r1"), *handed_over]
    token = hook.begin("auth", "Check", metadata)  # no current span here: the metadata carries it
    hook.end(token, grpc.StatusCode.OK)
    span = next(s for s in exporter.get_finished_spans() if s.name == "auth.check")
    assert span.parent is not None and span.parent.span_id == request_span.get_span_context().span_id
    assert [k for k, _ in metadata].count("traceparent") == 1  # replaced by the new span's, not added twice


def test_sampled_out_requests_record_nothing_but_still_carry_context() -> None:
    exporter = InMemorySpanExporter()
    tracing = Tracing(sample_ratio=0.0, exporters=[exporter], batch=False)
    metadata: list[tuple[str, str]] = []
    token = tracing.hook().begin("cache", "Lookup", metadata)
    tracing.hook().end(token, grpc.StatusCode.OK)
    assert exporter.get_finished_spans() == ()
    flags = int(dict(metadata)["traceparent"].rsplit("-", 1)[1], 16)
    assert flags & 0x01 == 0  # children follow the decision: not sampled


def test_tracing_is_off_by_default_and_bad_settings_name_the_field() -> None:
    assert Tracing.for_section(config_for_tests().tracing) is None
    assert TracingConfig.parse({}) == TracingConfig(enabled=False, sample_ratio=0.01, exporter="none")
    with pytest.raises(ConfigError, match=r"tracing\.sample_ratio.*1\.5"):
        TracingConfig.parse({"sample_ratio": 1.5}, "tracing")
    with pytest.raises(ConfigError, match=r"tracing\.exporter.*jaeger"):
        TracingConfig.parse({"exporter": "jaeger"}, "tracing")
    with pytest.raises(ConfigError, match=r"tracing\.ratio: unknown key; known: enabled, sample_ratio, exporter"):
        TracingConfig.parse({"ratio": 0.1}, "tracing")
    enabled = Tracing.for_section(TracingConfig.parse({"enabled": True, "sample_ratio": 0.5, "exporter": "none"}))
    assert enabled is not None
    enabled.shutdown()
