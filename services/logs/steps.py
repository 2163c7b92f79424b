"""The logs step: the pipeline writes one log line per finished request, whatever its outcome."""

from __future__ import annotations

from services.logs.api import LOGS, LogEntry, Logs
from services.pipeline.request_shape import log_fields
from services.pipeline.state import RequestState
from services.pipeline.step import Phase, Step, StepCall


class LogsStep(Step[Logs]):
    """The pipeline writes one log line per request, whatever its outcome (fail open)."""

    interface = LOGS
    method = "Append"
    phase = Phase.COMPLETE

    def wants(self, state: RequestState) -> bool:
        return True

    def decide(self, batch: list[RequestState], call: StepCall[Logs]) -> None:
        entries = [LogEntry(state.request_id, state.tenant,
                            state.model if state.resolved is not None else clipped(state.model), state.status,
                            state.latency_s * 1000.0, state.layout, state.cached, state.shadow,
                            log_fields(state.request, state.response or state.hit)) for state in batch]
        self.answered(call, batch, call.component.append(entries, call.options))


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
