"""What the model used and how long it took, read from its answer for the request's record.

A model's answer says what it used in two ways — counts in the answer (an upstream's usage)
and trailers (its load hint, an upstream's own time) — and the gateway reads both the same
way for a whole answer and for a stream's last chunk.
"""

from __future__ import annotations

from typing import Any

from services.pipeline.state import RequestState
from services.pipeline.verdicts import FORWARDED_TRAILERS, UPSTREAM_TIME_HEADER, rate_limit_cost


def used(state: RequestState, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
    """What the model used for `state` (its prompt counted by bytes where the model did not
    count it): what its tokens per minute are settled with and its spend priced on."""
    assert state.resolved is not None
    state.prompt_tokens = prompt_tokens or rate_limit_cost(state.resolved)
    state.completion_tokens = completion_tokens
    state.cached_tokens = min(cached_tokens, state.prompt_tokens)
    state.tokens_used = state.prompt_tokens + completion_tokens


def forwarded(trailing: Any) -> tuple[tuple[str, str], ...]:
    """The downstream trailers the client should see (load hints, the upstream's), nothing else."""
    return tuple((k, v) for k, v in trailing if k in FORWARDED_TRAILERS)


def model_time(state: RequestState, metadata: Any) -> bool:
    """Take the model's time from an upstream's own figure where the answer has one (the
    time its exchanges took, not the hop to the inference process); whether it had one."""
    for key, value in metadata:
        if key == UPSTREAM_TIME_HEADER:
            try:
                state.model_wait_s = float(value) / 1000.0
            except ValueError:
                return False
            return True
    return False
