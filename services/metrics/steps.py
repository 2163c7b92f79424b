"""What the pipeline tells the metrics of every finished request: the record, its batch rpc
(`RecordBatch`, shared with `services.metrics.service`) and the stage that sends it.

Apart from the servicer (whose tables keep tensors): a gateway whose metrics run in another
process imports these and not torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.common.genai_semconv import operation_name
from services.pipeline.batch_rpc import BatchRpc, status_only
from services.pipeline.state import RequestState
from services.pipeline.step import Phase, Step, StepCall
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


RECORD_BATCH: BatchRpc[Any, None] = status_only("RecordBatch", "record_items", _encode_records,
                                                metrics_pb2.RecordBatchResponse)


class MetricsStep(Step):
    """The pipeline counts and times every request, whatever its outcome (fail open)."""

    method = "Record"
    phase = Phase.COMPLETE

    def wants(self, state: RequestState) -> bool:
        return True

    def decide(self, batch: list[RequestState], call: StepCall) -> None:
        records = [_record(state) for state in batch]
        self.answered(call, batch, call.batch(RECORD_BATCH, records))


def _record(state: RequestState) -> MetricsRecord:
    record = MetricsRecord(state.layout, model_label(state), state.tenant, state.status, state.latency_s,
                           state.middleware_s, state.cached, state.shadow, state.completion_tokens,
                           state.failures, state.ejected, state.pregenerated, state.policy_violation)
    call, request = state.model_call, state.resolved
    if call is not None and request is not None:  # the model was called: a GenAI operation
        record.genai_operation = operation_name(request)
        record.genai_duration_s = call.duration_s
        record.time_to_first_chunk_s = call.first_chunk_s if call.stream else 0.0
        response = state.response
        if response is not None and state.status == "OK":
            record.response_model = response.model
            record.input_tokens = response.prompt_tokens
    return record


def model_label(state: RequestState) -> str:
    """The routed model's id; "" for a request stopped before routing (no credential, bad input,
    an unknown model). What such a client named is not a label: every name it made up would
    be a series of its own, kept for the life of the process (a client could fill the device
    budget with them), and a name may be as long as the message."""
    return state.model if state.resolved is not None else ""
