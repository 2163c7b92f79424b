"""The OpenTelemetry GenAI semantic conventions spine follows, version 1.41.0, in one place.

Read from the conventions' own text (semantic-conventions v1.41.0, `docs/gen-ai/gen-ai-spans.md`
and `gen-ai-metrics.md`, `model/gen-ai/*.yaml`; status: development). Newer releases moved
the GenAI conventions to a repository of their own; 1.41.0 is the last release that holds
them beside the rest, and what opentelemetry-semantic-conventions' constants name.

What spine emits and where (docs/metrics.md has the families, docs/design.md the why):

- a span per call of the model, made by the gateway in both layouts (`runtime.observability.genai_spans`):
  the GenAI *inference* client span, `{gen_ai.operation.name} {gen_ai.request.model}`, kind
  CLIENT; the model's own rpc span (`inference.generate`) is its child;
- the client metrics, from each request's record (the metrics component):
  `gen_ai.client.token.usage`, `gen_ai.client.operation.duration`,
  `gen_ai.client.operation.time_to_first_chunk` (streams);
- the model server's metrics (the inference component): `gen_ai.server.request.duration`,
  `gen_ai.server.time_to_first_token`, `gen_ai.server.time_per_output_token`.

Prometheus names follow OpenTelemetry's translation: dots become underscores and a unit of
seconds adds `_seconds` (`{token}`, an annotation, adds nothing); attribute names become
label names the same way (`gen_ai.request.model` -> `gen_ai_request_model`).

A light module (no OpenTelemetry import): the services that count use it without tracing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

VERSION = "1.41.0"
SCHEMA_URL = f"https://opentelemetry.io/schemas/{VERSION}"

# Attributes (registry names).
OPERATION_NAME = "gen_ai.operation.name"
PROVIDER_NAME = "gen_ai.provider.name"
REQUEST_MODEL = "gen_ai.request.model"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
REQUEST_SEED = "gen_ai.request.seed"
REQUEST_STREAM = "gen_ai.request.stream"
RESPONSE_ID = "gen_ai.response.id"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
RESPONSE_TIME_TO_FIRST_CHUNK = "gen_ai.response.time_to_first_chunk"
USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
TOKEN_TYPE = "gen_ai.token.type"
ERROR_TYPE = "error.type"

# `gen_ai.operation.name`: a request with a chat's messages (the HTTP chat endpoints fill
# them) is `chat`; a prompt alone (gRPC's Generate, `/v1/completions`) is `text_completion`.
CHAT = "chat"
TEXT_COMPLETION = "text_completion"
# `gen_ai.provider.name`: no well-known value applies to a model spine serves itself, so a
# custom one, as the convention allows: the provider as its client sees it.
PROVIDER = "spine"
# `gen_ai.token.type`
INPUT, OUTPUT = "input", "output"

# Explicit bucket boundaries, as the convention advises each histogram.
TOKEN_BUCKETS: tuple[float, ...] = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                               7.5, 10.0)
TIME_PER_OUTPUT_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


def prometheus_label(attribute: str) -> str:
    """An attribute's name as a Prometheus label (`gen_ai.request.model` -> `gen_ai_request_model`)."""
    return attribute.replace(".", "_")


@dataclass(frozen=True)
class Metric:
    """One GenAI histogram: its OpenTelemetry name, Prometheus family, unit, description,
    advised bucket boundaries and attributes (in label order)."""

    name: str
    family: str
    unit: str
    description: str
    buckets: tuple[float, ...]
    attributes: tuple[str, ...]

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(prometheus_label(attribute) for attribute in self.attributes)


MODEL_ATTRIBUTES = (OPERATION_NAME, PROVIDER_NAME, REQUEST_MODEL, RESPONSE_MODEL)
CLIENT_TOKEN_USAGE = Metric("gen_ai.client.token.usage", "gen_ai_client_token_usage", "{token}",
                            "Number of input and output tokens used.", TOKEN_BUCKETS, (*MODEL_ATTRIBUTES, TOKEN_TYPE))
CLIENT_OPERATION_DURATION = Metric(
    "gen_ai.client.operation.duration", "gen_ai_client_operation_duration_seconds", "s", "GenAI operation duration.",
    DURATION_BUCKETS, (*MODEL_ATTRIBUTES, ERROR_TYPE))
CLIENT_TIME_TO_FIRST_CHUNK = Metric(
    "gen_ai.client.operation.time_to_first_chunk", "gen_ai_client_operation_time_to_first_chunk_seconds", "s",
    "Time to receive the first chunk, measured from when the client issues the generation request to when the "
    "first chunk is received in the response stream.", DURATION_BUCKETS, MODEL_ATTRIBUTES)
SERVER_REQUEST_DURATION = Metric(
    "gen_ai.server.request.duration", "gen_ai_server_request_duration_seconds", "s",
    "Generative AI server request duration such as time-to-last byte or last output token.", DURATION_BUCKETS,
    (*MODEL_ATTRIBUTES, ERROR_TYPE))
SERVER_TIME_TO_FIRST_TOKEN = Metric(
    "gen_ai.server.time_to_first_token", "gen_ai_server_time_to_first_token_seconds", "s",
    "Time to generate first token for successful responses.", TIME_TO_FIRST_TOKEN_BUCKETS, MODEL_ATTRIBUTES)
SERVER_TIME_PER_OUTPUT_TOKEN = Metric(
    "gen_ai.server.time_per_output_token", "gen_ai_server_time_per_output_token_seconds", "s",
    "Time per output token generated after the first token for successful responses.",
    TIME_PER_OUTPUT_TOKEN_BUCKETS, MODEL_ATTRIBUTES)


def operation_name(request: Any) -> str:
    """`chat` for a request carrying a chat's messages, else `text_completion`."""
    return CHAT if request.messages else TEXT_COMPLETION
