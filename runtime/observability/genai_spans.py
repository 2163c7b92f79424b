"""The GenAI inference span of each model call, by the OpenTelemetry GenAI semantic
conventions (`services.common.genai_semconv`: version, names, what is recorded).

The gateway calls the model in every layout, so the span is made there: `{operation}
{model}` (`chat tiny-lm`, `text_completion tiny-lm`), kind CLIENT, a child of the request's
span, with the model's own rpc span (`inference.generate`, and in the layered layout the
model process's server span) under it. Its attributes come from the request the gateway
sends and the answer it receives, never from where the model runs, so they are the same in
both layouts. It starts with the call and ends when the request ends: after a unary
answer, or after a stream's last chunk was handed on (never when the call returns the
stream), an error or a cancel.

Set on span creation (they may decide sampling): `gen_ai.operation.name`,
`gen_ai.provider.name`, `gen_ai.request.model`, `gen_ai.request.max_tokens`,
`gen_ai.request.temperature`, `gen_ai.request.seed` (when the request has one),
`gen_ai.request.stream` (streams). At the end, for an answer: `gen_ai.response.id` (the
request id, as `x-request-id`), `gen_ai.response.model`, `gen_ai.response.finish_reasons`,
`gen_ai.usage.input_tokens`, `gen_ai.usage.output_tokens`; for a stream whose first chunk
came, `gen_ai.response.time_to_first_chunk` (seconds); for an error, `error.type` (the gRPC
status code's name the request ended with) and the span's status ERROR. `server.address`
and `server.port` are left out: where the model runs is what differs between layouts.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.common import genai_semconv as semconv
from services.pipeline.request_shape import span_attributes
from services.pipeline.state import RequestState


class GenAiSpans:
    """A `services.gateway.model_calls.ModelCallSpans` on a tracer."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self.tracer = tracer

    @contextmanager
    def calling(self, state: RequestState) -> Iterator[None]:
        request, call = state.resolved, state.model_call
        if request is None or call is None:
            yield
            return
        operation = semconv.operation_name(request)
        attributes: dict[str, Any] = {
            semconv.OPERATION_NAME: operation, semconv.PROVIDER_NAME: semconv.PROVIDER,
            semconv.REQUEST_MODEL: request.model, semconv.REQUEST_MAX_TOKENS: request.max_tokens,
            semconv.REQUEST_TEMPERATURE: float(request.temperature)}
        if request.HasField("seed"):
            attributes[semconv.REQUEST_SEED] = request.seed
        attributes.update(span_attributes(request))  # what the client's whole body asks for
        if call.stream:
            attributes[semconv.REQUEST_STREAM] = True
        span = self.tracer.start_span(f"{operation} {request.model}", kind=SpanKind.CLIENT, attributes=attributes)
        call.span = span
        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            yield
        finally:
            otel_context.detach(token)

    def end(self, state: RequestState) -> None:
        call = state.model_call
        span = call.span if call is not None else None
        if call is None or span is None:
            return
        call.span = None
        if span.is_recording():
            span.set_attributes(end_attributes(state))
            if state.status != "OK":
                span.set_status(Status(StatusCode.ERROR, state.status))
        span.end()


def end_attributes(state: RequestState) -> dict[str, Any]:
    """What the span learns when the request ends (see the module's doc)."""
    attributes: dict[str, Any] = {}
    call, response = state.model_call, state.response
    if response is not None and state.status == "OK":
        attributes[semconv.RESPONSE_ID] = state.request_id
        attributes[semconv.RESPONSE_MODEL] = response.model
        if response.finish_reason:
            attributes[semconv.RESPONSE_FINISH_REASONS] = (response.finish_reason,)
        attributes[semconv.USAGE_INPUT_TOKENS] = response.prompt_tokens
        attributes[semconv.USAGE_OUTPUT_TOKENS] = response.completion_tokens
    if call is not None and call.stream and call.first_chunk_s > 0:
        attributes[semconv.RESPONSE_TIME_TO_FIRST_CHUNK] = call.first_chunk_s
    if state.status != "OK":
        attributes[semconv.ERROR_TYPE] = state.status
    return attributes
