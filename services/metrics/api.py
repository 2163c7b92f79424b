"""The metrics component as its callers see it, wherever it runs: `Metrics`, its MetricsRecord, and how
its one operation crosses the wire (`RecordBatch`).

Apart from the servicer: a gateway whose metrics run in another process imports this and not torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from services.pipeline.batch_rpc import BatchRpc, ItemError, status_only
from services.pipeline.interface import NO_OPTIONS, CallOptions, Interface
from wire.v1 import metrics_pb2


@dataclass(slots=True)  # not frozen: see services.pipeline.batch_rpc
class MetricsRecord:
    """One finished request as the metrics count it (the fields of `spine.v1.RequestRecord`)."""

    layout: str
    model: str
    tenant: str
    status: str
    latency_s: float
    middleware_s: Mapping[str, float]
    cached: bool = False
    shadow: bool = False
    completion_tokens: int = 0
    failed_middlewares: Sequence[str] = ()
    ejected_middlewares: Sequence[str] = ()
    pregenerated: bool = False
    policy_violation: bool = False
    genai_operation: str = ""  # the model call as a GenAI operation ("": no call; see RequestRecord)
    response_model: str = ""
    input_tokens: int = 0
    genai_duration_s: float = 0.0
    time_to_first_chunk_s: float = 0.0


def _encode_records(records: Sequence[MetricsRecord]) -> metrics_pb2.RecordBatchRequest:
    request = metrics_pb2.RecordBatchRequest()
    for r in records:
        request.records.add(layout=r.layout, model=r.model, tenant=r.tenant, status=r.status, latency_s=r.latency_s,
                            middleware_s=r.middleware_s, cached=r.cached, shadow=r.shadow,
                            completion_tokens=r.completion_tokens, failed_middlewares=r.failed_middlewares,
                            ejected_middlewares=r.ejected_middlewares, pregenerated=r.pregenerated,
                            policy_violation=r.policy_violation, genai_operation=r.genai_operation,
                            response_model=r.response_model, input_tokens=r.input_tokens,
                            genai_duration_s=r.genai_duration_s, time_to_first_chunk_s=r.time_to_first_chunk_s)
    return request


RECORD_BATCH: BatchRpc[MetricsRecord, None, metrics_pb2.RecordBatchRequest, metrics_pb2.RecordBatchResponse] = status_only("RecordBatch", "record", _encode_records,
                                                metrics_pb2.RecordBatchResponse)




class Metrics(Protocol):
    """Counts and times every finished request."""

    def record(self, items: Sequence[MetricsRecord], options: CallOptions = NO_OPTIONS) -> list[ItemError | None]:
        """Each item written (None) or refused alone (its status)."""
        ...


METRICS: Interface[Metrics] = Interface("metrics", [RECORD_BATCH])
