"""The gateway's calls of the model as GenAI operations: what it notes of each, and the span hook.

The gateway makes the model call in every layout (the model's binding is local in the spine,
a gRPC stub in the layered gateway), so what it notes on `RequestState.model_call` — when
the call began, a stream's first chunk, when the answer or the last chunk went out — and the
answer itself give the same GenAI span and metrics in both layouts. The span is the
runtime's (`runtime.genai_spans`, set on `Gateway.genai` while tracing is on); the metrics
are the metrics component's, from each request's record (`services.metrics.genai`).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Protocol

from services.pipeline.state import RequestState


class ModelCallSpans(Protocol):
    """Traces the model calls (the GenAI inference span): `calling` around the call, which
    starts the span and makes it the current one (the binding's rpc span is its child);
    `end` when the request ends (a stream: after its last chunk), from `state.model_call`
    and the answer. Must never raise."""

    def calling(self, state: RequestState) -> contextlib.AbstractContextManager[Any]: ...

    def end(self, state: RequestState) -> None: ...


NOT_TRACED = contextlib.nullcontext()  # the call's context while tracing is off


def first_chunk(state: RequestState) -> None:
    """A stream's first chunk came: its time to first chunk, from the call's start."""
    call = state.model_call
    if call is not None:
        call.first_chunk_s = time.perf_counter() - call.started
