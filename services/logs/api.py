"""The logs component as its callers see it, wherever it runs: `Logs`, its LogEntry, and how
its one operation crosses the wire (`AppendBatch`).

Apart from the servicer: a gateway whose logs run in another process imports this and not torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from services.pipeline.batch_rpc import BatchRpc, ItemError, status_only
from services.pipeline.interface import NO_OPTIONS, CallOptions, Interface
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


APPEND_BATCH: BatchRpc[LogEntry, None, logs_pb2.AppendBatchRequest, logs_pb2.AppendBatchResponse] = status_only("AppendBatch", "append", _encode_entries,
                                                logs_pb2.AppendBatchResponse)




class Logs(Protocol):
    """One log line per finished request."""

    def append(self, items: Sequence[LogEntry], options: CallOptions = NO_OPTIONS) -> list[ItemError | None]:
        """Each item written (None) or refused alone (its status)."""
        ...


LOGS: Interface[Logs] = Interface("logs", [APPEND_BATCH])
