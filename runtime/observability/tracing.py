"""OpenTelemetry spans with the same names in both layouts.

Two pieces make one trace per request, whatever the placement:

- `TracingHook`, a `services.pipeline.calls.Hook`: a span per middleware call (`auth.check`,
  `ratelimit.admit`, …), started by the binding in the gateway's process, so a local
  call and a remote one produce the same span under the same parent. It injects W3C
  trace context (`traceparent`) into the call's metadata.
- `TraceContextInterceptor`, a server interceptor: continues the caller's trace. On the
  gateway's server it opens the `gateway.generate` root; in a layered child it opens a
  server span (`spine.v1.Auth/Check`) that is a child of the gateway's `auth.check`.

Cost: a sampled-out request still pays for a non-recording span per call; exporting
every span synchronously costs more per RPC than a middleware's own decision. So tracing is
off by default, samples a small ratio when on (parent-based: one decision per request), and
exports through a `BatchSpanProcessor` off the request path.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from runtime.config.sections import EXPORTERS as EXPORTERS
from runtime.config.sections import TracingConfig
from runtime.config.sections import otlp_available as otlp_available

# A server interceptor of any request and response (generic in grpc's stubs only).
if TYPE_CHECKING:
    Interceptor = grpc.ServerInterceptor[Any, Any]
else:
    Interceptor = grpc.ServerInterceptor

ROOT_SPAN = "gateway.generate"


# Server spans named by the public methods they serve; anything else keeps its gRPC name.
SERVER_SPAN_NAMES: dict[str, str] = {
    "/spine.v1.Gateway/Generate": ROOT_SPAN,
    "/spine.v1.Gateway/GenerateStream": ROOT_SPAN,
}
LAYOUT_ATTRIBUTE = "spine.layout"
_PROPAGATOR = TraceContextTextMapPropagator()


def current_traceparent() -> tuple[tuple[str, str], ...]:
    """The current span's W3C context as metadata, for work handed to another thread."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return tuple(carrier.items())


def span_name(component: str, method: str) -> str:
    """A call's span name, the same in every layout: its component and the operation its
    step stands for (`auth.check`, `inference.generate`)."""
    return f"{component}.{method.lower()}"


def make_exporter(name: str) -> SpanExporter | None:
    """The exporter a config names; None for 'none'."""
    if name == "console":
        return ConsoleSpanExporter()
    if name == "otlp":
        module = importlib.import_module("opentelemetry.exporter.otlp.proto.grpc.trace_exporter")
        exporter: SpanExporter = module.OTLPSpanExporter()
        return exporter
    return None


class SpanTimes(SpanProcessor):
    """Adds up span durations per (layout, span name) in memory: what `spine ab` reports.

    Cheaper than any exporter (one dict update per span, no serialization).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.totals: dict[tuple[str, str], float] = {}
        self.counts: dict[tuple[str, str], int] = {}

    def on_end(self, span: ReadableSpan) -> None:
        if span.start_time is None or span.end_time is None:
            return
        layout = str((span.attributes or {}).get(LAYOUT_ATTRIBUTE, ""))
        key = (layout, span.name)
        seconds = (span.end_time - span.start_time) / 1e9
        with self._lock:
            self.totals[key] = self.totals.get(key, 0.0) + seconds
            self.counts[key] = self.counts.get(key, 0) + 1

    def reset(self) -> None:
        """Forget every span so far (`spine ab` drops its warm-up's this way)."""
        with self._lock:
            self.totals.clear()
            self.counts.clear()

    def snapshot(self) -> dict[str, dict[str, dict[str, float]]]:
        """{layout: {span name: {"count": n, "total_s": s, "mean_ms": m}}}."""
        with self._lock:
            result: dict[str, dict[str, dict[str, float]]] = {}
            for (layout, name), total in self.totals.items():
                count = self.counts[(layout, name)]
                result.setdefault(layout, {})[name] = {"count": count, "total_s": total,
                                                       "mean_ms": total / count * 1000.0}
            return result


class Tracing:
    """A tracer provider of our own (never the process-global one), its hook and interceptor."""

    def __init__(self, *, sample_ratio: float = 1.0, exporters: Sequence[SpanExporter] = (),
                 processors: Sequence[SpanProcessor] = (), service_name: str = "spine",
                 batch: bool = True) -> None:
        self.provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(sample_ratio)),
                                       resource=Resource.create({"service.name": service_name}))
        for exporter in exporters:
            self.provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
        for processor in processors:
            self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("spine")

    @classmethod
    def for_section(cls, settings: TracingConfig, service_name: str = "spine") -> Tracing | None:
        """Tracing as the `tracing` section asks, or None when it is off."""
        if not settings.enabled:
            return None
        exporter = make_exporter(settings.exporter)
        return cls(sample_ratio=settings.sample_ratio, exporters=[exporter] if exporter else [],
                   service_name=service_name)

    def hook(self, layout: str = "") -> TracingHook:
        return TracingHook(self.tracer, layout)

    def server_interceptor(self) -> TraceContextInterceptor:
        return TraceContextInterceptor(self.tracer)

    def flush(self, timeout_s: float = 5.0) -> None:
        self.provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        self.provider.shutdown()


class TracingHook:
    """A `Hook`: one span per middleware call, trace context into the metadata."""

    may_block = False  # a span is begun and ended in memory; the exporter sends from its own thread

    def __init__(self, tracer: trace.Tracer, layout: str = "") -> None:
        self.tracer = tracer
        self.layout = layout

    def begin(self, component: str, method: str, metadata: list[tuple[str, str]]) -> Any:
        attributes = {"rpc.system": "grpc", "rpc.method": method, "spine.component": component}
        if self.layout:
            attributes[LAYOUT_ATTRIBUTE] = self.layout
        # A caller that runs the call away from the request's thread (a batch step) can name
        # the parent by putting the request's traceparent in the metadata; else the current span.
        parent = None
        if any(key == "traceparent" for key, _ in metadata):
            parent = _PROPAGATOR.extract({k: v for k, v in metadata if k in ("traceparent", "tracestate")})
            metadata[:] = [(k, v) for k, v in metadata if k not in ("traceparent", "tracestate")]
        span = self.tracer.start_span(span_name(component, method), context=parent, kind=SpanKind.CLIENT,
                                      attributes=attributes)
        if span.get_span_context().is_valid:
            carrier: dict[str, str] = {}
            _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
            metadata.extend(carrier.items())
        return span

    @staticmethod
    def capture() -> tuple[tuple[str, str], ...]:
        """The request's trace context, for its part of a batch decided on another thread."""
        return current_traceparent()

    def end(self, token: Any, code: grpc.StatusCode) -> None:
        span: trace.Span = token
        if span.is_recording():
            span.set_attribute("rpc.grpc.status_code", int(code.value[0]))
            if code != grpc.StatusCode.OK:
                span.set_status(Status(StatusCode.ERROR, code.name))
        span.end()


class TraceContextInterceptor(Interceptor):
    """Continues the caller's trace (or starts one) around every handler of a server."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self.tracer = tracer

    def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        method = str(handler_call_details.method)
        if handler is None or method.startswith(("/grpc.health.", "/grpc.reflection.")):
            return handler
        name = SERVER_SPAN_NAMES.get(method, method.lstrip("/"))
        metadata = handler_call_details.invocation_metadata or ()
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(name, metadata, handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(name, metadata, handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        return handler  # client streaming is not part of any spine API

    def _parent(self, metadata: Sequence[Any]) -> otel_context.Context:
        carrier = {str(item[0]): str(item[1]) for item in metadata if item[0] in ("traceparent", "tracestate")}
        return _PROPAGATOR.extract(carrier)

    def _span(self, name: str, metadata: Sequence[Any]) -> Any:
        """The server span. On the public API a client's trace context is a link, not a
        parent: its sampled flag must not switch tracing on (a cost a client could force),
        so the request gets a root of its own, sampled by the spine's own ratio."""
        parent = self._parent(metadata)
        if name != ROOT_SPAN:
            return self.tracer.start_as_current_span(name, context=parent, kind=SpanKind.SERVER)
        caller = trace.get_current_span(parent).get_span_context()
        links = [Link(caller)] if caller.is_valid else []
        return self.tracer.start_as_current_span(name, context=otel_context.Context(), kind=SpanKind.SERVER,
                                                 links=links)

    def _unary(self, name: str, metadata: Sequence[Any], behaviour: Callable[[Any, Any], Any]) -> Callable[..., Any]:
        def handle(request: Any, context: Any) -> Any:
            with self._span(name, metadata):
                return behaviour(request, context)
        return handle

    def _stream(self, name: str, metadata: Sequence[Any],
                behaviour: Callable[[Any, Any], Iterator[Any]]) -> Callable[..., Iterator[Any]]:
        def handle(request: Any, context: Any) -> Iterator[Any]:
            # gRPC iterates a response stream in one worker thread, so the span stays current throughout.
            with self._span(name, metadata):
                yield from behaviour(request, context)
        return handle


# -- the process's tracing --------------------------------------------------------
_installed: Tracing | None = None


def install(tracing: Tracing | None) -> None:
    """Make every gRPC server started from now on in this process continue traces."""
    global _installed
    from runtime.server import set_default_interceptors

    _installed = tracing
    set_default_interceptors([tracing.server_interceptor()] if tracing is not None else [])


def installed() -> Tracing | None:
    return _installed


def install_for(settings: TracingConfig, service_name: str = "spine") -> Tracing | None:
    """For a process entry point: tracing as the `tracing` section asks (None and nothing
    installed when off)."""
    tracing = Tracing.for_section(settings, service_name)
    if tracing is not None:
        install(tracing)
    return tracing


@contextmanager
def installed_tracing(tracing: Tracing) -> Iterator[Tracing]:
    """Install `tracing` for a block (tests, `spine ab`), then put back what was there."""
    previous = _installed
    install(tracing)
    try:
        yield tracing
    finally:
        install(previous)
        tracing.flush()


__all__ = ["ROOT_SPAN", "SpanTimes", "Tracing", "TracingConfig", "TracingHook",
           "TraceContextInterceptor", "install", "install_for", "installed", "installed_tracing"]
