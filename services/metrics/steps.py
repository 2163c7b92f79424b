"""What the pipeline tells the metrics of every finished request: the record, its batch rpc
(`RecordBatch`, shared with `services.metrics.service`) and the step that sends it.

Apart from the servicer (whose tables keep tensors): a gateway whose metrics run in another
process imports these and not torch.
"""

from __future__ import annotations

from services.common.genai_semconv import operation_name
from services.metrics.api import METRICS, Metrics, MetricsRecord
from services.pipeline.state import RequestState
from services.pipeline.step import Phase, Step, StepCall


class MetricsStep(Step[Metrics]):
    """The pipeline counts and times every request, whatever its outcome (fail open)."""

    interface = METRICS
    method = "Record"
    phase = Phase.COMPLETE

    def wants(self, state: RequestState) -> bool:
        return True

    def decide(self, batch: list[RequestState], call: StepCall[Metrics]) -> None:
        records = [_record(state) for state in batch]
        self.answered(call, batch, call.component.record(records, call.options))


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
