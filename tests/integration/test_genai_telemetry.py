"""GenAI telemetry checked against OpenTelemetry's GenAI semantic conventions, version 1.41.0.

The convention below is written out here from its text (semantic-conventions v1.41.0,
`model/gen-ai/spans.yaml`, `registry.yaml`, `metrics.yaml`), not imported from the code under
test: the spans come out of OTel's in-memory exporter, the metrics out of `/metrics`, and
both are held to it — requirement levels, types, enum values, span name and kind, metric
names, units and bucket boundaries — in both layouts, which must give the same attributes.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client.parser import text_string_to_metric_families

from runtime.config.file import placements_for
from runtime.observability.tracing import Tracing, installed_tracing
from runtime.stack import Stack
from spine.client.gateway_client import GatewayClient
from tests.conftest import DEV_KEY, config_for_tests
from tests.http_helpers import openai_client
from tests.unit.test_serving_support import make_service
from tests.waiting import eventually
from wire.v1 import generation_pb2

# -- the convention (v1.41.0), as its text states it ------------------------------------------
OPERATIONS = {"chat", "create_agent", "embeddings", "execute_tool", "generate_content", "invoke_agent",
              "invoke_workflow", "retrieval", "text_completion"}
# The inference span's attributes: name -> (requirement level, type).
SPAN_ATTRIBUTES: dict[str, tuple[str, type | tuple[type, ...]]] = {
    "gen_ai.operation.name": ("required", str),
    "gen_ai.provider.name": ("required", str),
    "error.type": ("conditionally_required", str),  # if the operation ended in an error
    "gen_ai.conversation.id": ("conditionally_required", str),
    "gen_ai.output.type": ("conditionally_required", str),
    "gen_ai.request.choice.count": ("conditionally_required", int),
    "gen_ai.request.model": ("conditionally_required", str),  # if available
    "gen_ai.request.seed": ("conditionally_required", int),  # if the request includes a seed
    "gen_ai.request.stream": ("conditionally_required", bool),  # if and only if streaming
    "server.port": ("conditionally_required", int),  # if server.address is set
    "gen_ai.request.frequency_penalty": ("recommended", float),
    "gen_ai.request.max_tokens": ("recommended", int),
    "gen_ai.request.presence_penalty": ("recommended", float),
    "gen_ai.request.stop_sequences": ("recommended", tuple),
    "gen_ai.request.temperature": ("recommended", float),
    "gen_ai.request.top_k": ("recommended", float),
    "gen_ai.request.top_p": ("recommended", float),
    "gen_ai.response.finish_reasons": ("recommended", tuple),  # string[]
    "gen_ai.response.id": ("recommended", str),
    "gen_ai.response.model": ("recommended", str),
    "gen_ai.response.time_to_first_chunk": ("recommended", float),  # if the request was streaming
    "gen_ai.usage.cache_creation.input_tokens": ("recommended", int),
    "gen_ai.usage.cache_read.input_tokens": ("recommended", int),
    "gen_ai.usage.input_tokens": ("recommended", int),
    "gen_ai.usage.output_tokens": ("recommended", int),
    "gen_ai.usage.reasoning.output_tokens": ("recommended", int),
    "server.address": ("recommended", str),
}
# Set at span creation (they may decide sampling), where set at all.
AT_CREATION = ("gen_ai.operation.name", "gen_ai.provider.name", "gen_ai.request.model", "server.address",
               "server.port")
TOKEN_BUCKETS = [1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864]
DURATION_BUCKETS = [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92]
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
MODEL_LABELS = {"gen_ai_operation_name", "gen_ai_provider_name", "gen_ai_request_model", "gen_ai_response_model"}
# Prometheus family (OTel's translation: `.` -> `_`, unit s -> _seconds) -> (buckets, labels beside the model's).
METRICS: dict[str, tuple[list[float], set[str]]] = {
    "gen_ai_client_token_usage": (TOKEN_BUCKETS, {"gen_ai_token_type"}),
    "gen_ai_client_operation_duration_seconds": (DURATION_BUCKETS, {"error_type"}),
    "gen_ai_client_operation_time_to_first_chunk_seconds": (DURATION_BUCKETS, set()),
    "gen_ai_server_request_duration_seconds": (DURATION_BUCKETS, {"error_type"}),
    "gen_ai_server_time_to_first_token_seconds": (TTFT_BUCKETS, set()),
    "gen_ai_server_time_per_output_token_seconds": (TPOT_BUCKETS, set()),
}


def violations(span: ReadableSpan, *, stream: bool, seed: bool, failed: bool) -> list[str]:
    """Where an inference span breaks the convention (empty: it follows it)."""
    attributes = dict(span.attributes or {})
    found: list[str] = []
    for name, value in attributes.items():
        if name.startswith("gen_ai.") or name in ("error.type", "server.address", "server.port"):
            if name not in SPAN_ATTRIBUTES:
                found.append(f"{name}: not an attribute of the inference span")
                continue
            kind = SPAN_ATTRIBUTES[name][1]
            if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
                found.append(f"{name}: {type(value).__name__}, expected {kind}")
            if kind is tuple and not all(isinstance(item, str) for item in value):
                found.append(f"{name}: expected strings")
    for name, (level, _) in SPAN_ATTRIBUTES.items():
        if level == "required" and name not in attributes:
            found.append(f"{name}: required, missing")
    if attributes.get("gen_ai.operation.name") not in OPERATIONS:
        found.append(f"gen_ai.operation.name: {attributes.get('gen_ai.operation.name')!r} is not a well-known value")
    if "gen_ai.request.model" not in attributes:
        found.append("gen_ai.request.model: available (the request names it), missing")
    if ("gen_ai.request.stream" in attributes) != stream or attributes.get("gen_ai.request.stream") is False:
        found.append("gen_ai.request.stream: set if and only if the request streams")
    if ("gen_ai.request.seed" in attributes) != seed:
        found.append("gen_ai.request.seed: set if and only if the request has a seed")
    if ("error.type" in attributes) != failed:
        found.append("error.type: set if and only if the operation ended in an error")
    if failed and span.status.status_code != StatusCode.ERROR:
        found.append("status: an error's span has status ERROR")
    if "server.address" in attributes and "server.port" not in attributes:
        found.append("server.port: required with server.address")
    if span.name != f"{attributes.get('gen_ai.operation.name')} {attributes.get('gen_ai.request.model')}":
        found.append(f"name {span.name!r}: expected '{{gen_ai.operation.name}} {{gen_ai.request.model}}'")
    if span.kind not in (SpanKind.CLIENT, SpanKind.INTERNAL):
        found.append(f"kind {span.kind}: expected CLIENT (or INTERNAL in process)")
    return found


# -- the layouts, traced --------------------------------------------------------------------
class Traced:
    """A layout started with tracing installed, and what it exported."""

    def __init__(self, layout: str, tmp: Path) -> None:
        self.exporter = InMemorySpanExporter()
        self.tracing = Tracing(sample_ratio=1.0, exporters=[self.exporter], batch=False)
        config = config_for_tests()
        with installed_tracing(self.tracing):  # the stack's hooks and its gateway read it at start
            self.stack = Stack(config, placements_for(layout, config), run_dir=tmp / layout,
                               http_listen="127.0.0.1:0").start()

    def genai(self, since: int = 0) -> list[ReadableSpan]:
        spans = self.exporter.get_finished_spans()[since:]
        return [span for span in spans if "gen_ai.operation.name" in (span.attributes or {})]

    def metrics_text(self) -> str:
        self.stack.drain()
        local = self.stack.local_servicers.get("metrics")
        if local is not None:
            return str(local.render())
        address = self.stack.metrics_address()
        assert address is not None
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as answer:
            return str(answer.read().decode())


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Traced]]:
    tmp = tmp_path_factory.mktemp("genai")
    layouts: dict[str, Traced] = {}
    try:
        for layout in ("collapsed", "layered"):
            layouts[layout] = Traced(layout, tmp)
        yield layouts
    finally:
        for running in layouts.values():
            running.stack.stop()


WORKLOAD = (  # (kind, request fields): each a different shape of the GenAI operation
    ("unary", {"prompt": "the unary one", "max_tokens": 4}),
    ("unary", {"prompt": "with a seed", "max_tokens": 3, "temperature": 0.7, "seed": 42}),
    ("stream", {"prompt": "the streamed one", "max_tokens": 5}),
    ("unary", {"prompt": "x" * 2000, "max_tokens": 256}),  # past the model's context: the model refuses
)


def _run(running: Traced) -> list[tuple[str, dict[str, Any], ReadableSpan]]:
    before = len(running.exporter.get_finished_spans())
    outcomes = []
    with GatewayClient(running.stack.address, DEV_KEY) as client:
        for kind, fields in WORKLOAD:
            request = generation_pb2.GenerateRequest(model="default", **fields)
            result = client.stream(request) if kind == "stream" else client.generate(request)
            outcomes.append(result.code)
    chat = openai_client(running.stack).chat.completions.create(  # over HTTP: the same gateway
        model="tiny", max_tokens=3, temperature=0, messages=[{"role": "user", "content": "a chat"}])
    assert chat.usage is not None and chat.usage.completion_tokens == 3
    spans = running.genai(before)
    assert len(spans) == len(WORKLOAD) + 1, [s.name for s in spans]
    assert outcomes[:3] == [grpc.StatusCode.OK] * 3 and outcomes[3] != grpc.StatusCode.OK
    kinds = [*WORKLOAD, ("unary", {"chat": True})]
    by_request = sorted(spans, key=lambda span: span.start_time or 0)
    return [(kind, fields, span) for (kind, fields), span in zip(kinds, by_request, strict=True)]


def _comparable(span: ReadableSpan) -> dict[str, Any]:
    """A span's attributes less what differs per request whatever the layout (its id, a time)."""
    return {k: v for k, v in (span.attributes or {}).items()
            if k not in ("gen_ai.response.id", "gen_ai.response.time_to_first_chunk")}


def test_spans_follow_the_convention_and_are_the_same_in_both_layouts(traced: Mapping[str, Traced]) -> None:
    runs = {layout: _run(running) for layout, running in traced.items()}
    for layout, run in runs.items():
        for kind, fields, span in run:
            problems = violations(span, stream=kind == "stream", seed="seed" in fields,
                                  failed=fields.get("max_tokens") == 256)
            assert not problems, (layout, span.name, problems)
    collapsed, layered = runs["collapsed"], runs["layered"]
    assert [_comparable(span) for *_, span in collapsed] == [_comparable(span) for *_, span in layered]
    unary, seeded, streamed, refused, chat = (span.attributes or {} for *_, span in collapsed)
    assert unary["gen_ai.operation.name"] == "text_completion" and chat["gen_ai.operation.name"] == "chat"
    assert unary["gen_ai.request.model"] == "tiny-lm" == unary["gen_ai.response.model"]  # the routed model
    assert unary["gen_ai.usage.output_tokens"] == 4 and unary["gen_ai.usage.input_tokens"] > 0
    assert unary["gen_ai.response.finish_reasons"] == ("length",) and seeded["gen_ai.request.seed"] == 42
    assert streamed["gen_ai.usage.output_tokens"] == 5 and streamed["gen_ai.response.time_to_first_chunk"] > 0
    assert refused["error.type"] == "INVALID_ARGUMENT" and "gen_ai.usage.output_tokens" not in refused
    for *_, span in collapsed:  # the model's rpc span is the GenAI span's child
        children = [s for s in traced["collapsed"].exporter.get_finished_spans()
                    if s.parent is not None and span.context is not None and s.parent.span_id == span.context.span_id]
        assert [child.name for child in children] == ["inference.generate"]


def test_metrics_have_the_conventions_names_buckets_and_labels_in_both_layouts(
        traced: Mapping[str, Traced]) -> None:
    for layout, running in traced.items():
        with GatewayClient(running.stack.address, DEV_KEY) as client:  # at least one of each
            assert client.stream(generation_pb2.GenerateRequest(model="tiny", prompt=f"metrics {layout}",
                                                                 max_tokens=3)).ok
            refused = client.generate(generation_pb2.GenerateRequest(model="tiny", prompt="y" * 2000, max_tokens=256))
            assert refused.code == grpc.StatusCode.INVALID_ARGUMENT  # by the model: past its context
        families = {family.name: family for family in text_string_to_metric_families(running.metrics_text())}
        for name, (buckets, extra) in METRICS.items():
            assert name in families and families[name].type == "histogram", (layout, name)
            samples = families[name].samples
            assert samples, (layout, name)
            for sample in samples:
                assert set(sample.labels) - {"le"} == MODEL_LABELS | extra, (layout, name, sample.labels)
                assert sample.labels["gen_ai_provider_name"] and sample.labels["gen_ai_operation_name"] in OPERATIONS
            bounds = sorted({float(s.labels["le"]) for s in samples if s.name.endswith("_bucket")} - {float("inf")})
            assert bounds == [float(b) for b in buckets], (layout, name)
        usage = {(s.labels["gen_ai_token_type"], s.labels["gen_ai_operation_name"]): s.value
                 for s in families["gen_ai_client_token_usage"].samples if s.name.endswith("_count")}
        assert usage[("input", "text_completion")] == usage[("output", "text_completion")] >= 1
        for family in ("gen_ai_client_operation_duration_seconds", "gen_ai_server_request_duration_seconds"):
            errors = {s.labels["error_type"] for s in families[family].samples}
            assert {"", "INVALID_ARGUMENT"} <= errors, (layout, family, errors)  # answered, and refused by its code
        server = [s for s in families["gen_ai_server_time_to_first_token_seconds"].samples
                  if s.name.endswith("_count")]
        assert server and all(s.labels["gen_ai_request_model"] for s in server)


def test_a_streams_span_ends_at_its_last_chunk_not_when_the_call_returns(tmp_path: Path) -> None:
    service, model = make_service(kv_cache_max_entries=2, max_batch=2)
    exporter = InMemorySpanExporter()
    config = config_for_tests()
    with installed_tracing(Tracing(sample_ratio=1.0, exporters=[exporter], batch=False)):
        stack = Stack(config, placements_for("collapsed", config), run_dir=tmp_path,
                      servicers={"inference": service}).start()
    try:
        model.hold()
        with GatewayClient(stack.address, DEV_KEY) as client:
            request = generation_pb2.GenerateRequest(model="tiny-lm", prompt="held stream", max_tokens=3)
            chunks = client.stub.GenerateStream(request, metadata=client.metadata(), timeout=30)
            model.release(1)
            first = next(chunks, None)  # the first chunk is out; the model is held before the next
            assert first is not None, (chunks.code(), chunks.details())
            assert first.token_ids
            assert not [s for s in exporter.get_finished_spans() if s.name == "text_completion tiny-lm"]
            model.open()
            rest = list(chunks)
        eventually(lambda: any(s.name == "text_completion tiny-lm" for s in exporter.get_finished_spans()))
        span = next(s for s in exporter.get_finished_spans() if s.name == "text_completion tiny-lm")
        model_span = next(s for s in exporter.get_finished_spans() if s.name == "inference.generate")
        assert rest[-1].finish_reason and (span.attributes or {})["gen_ai.usage.output_tokens"] == 3
        assert (span.end_time or 0) >= (model_span.end_time or 0)  # it outlives the model's rpc
    finally:
        stack.stop()
        service.close()
