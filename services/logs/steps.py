"""The logs step: the pipeline writes one log line per finished request, whatever its outcome."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.pipeline.batch_rpc import BatchRpc, status_only
from services.pipeline.state import RequestState
from services.pipeline.step import Phase, Step, StepCall
from wire.v1 import logs_pb2


@dataclass(slots=True)  # not frozen: see services.pipeline.batch_rpc
class LogEntry:
    """One finished request as the log writes it (the fields of `spine.v1.LogRecord`)."""

    request_id: str
    tenant: str
    model: str
    status: str
    latency_ms: float
    layout: str
    cached: bool = False
    shadow: bool = False
    fields: Mapping[str, str] = field(default_factory=dict)


def _encode_entries(entries: Sequence[LogEntry]) -> logs_pb2.AppendBatchRequest:
    return logs_pb2.AppendBatchRequest(records=[
        logs_pb2.LogRecord(request_id=e.request_id, tenant=e.tenant, model=e.model, status=e.status,
                           latency_ms=e.latency_ms, layout=e.layout, cached=e.cached, shadow=e.shadow, fields=e.fields)
        for e in entries])


APPEND_BATCH: BatchRpc[Any, None] = status_only("AppendBatch", "append_items", _encode_entries,
                                                logs_pb2.AppendBatchResponse)


class LogsStep(Step):
    """The pipeline writes one log line per request, whatever its outcome (fail open)."""

    method = "Append"
    phase = Phase.COMPLETE

    def wants(self, state: RequestState) -> bool:
        return True

    def decide(self, batch: list[RequestState], call: StepCall) -> None:
        entries = [LogEntry(state.request_id, state.tenant,
                            state.model if state.resolved is not None else clipped(state.model), state.status,
                            state.latency_s * 1000.0, state.layout, state.cached, state.shadow) for state in batch]
        self.answered(call, batch, call.batch(APPEND_BATCH, entries))


# A model name a client sent that the router did not resolve is logged cut to this many
# characters: any longer, and one name could push the line past `max_line_bytes`, so the
# request would leave no line at all.
MAX_UNROUTED_MODEL_CHARS = 200


def clipped(name: str) -> str:
    """`name` as logged for a request that was not routed: at most MAX_UNROUTED_MODEL_CHARS
    characters, and a mark with the full length where it was cut."""
    if len(name) <= MAX_UNROUTED_MODEL_CHARS:
        return name
    return f"{name[:MAX_UNROUTED_MODEL_CHARS]}...({len(name)} characters)"
