"""The output policy where every answer passes the gateway, in every layout.

A whole answer (the model's or the cache's) is checked before it is returned, its text and
its tool calls' arguments alike; a stream's chunk before it is released, so a violating
chunk never reaches the client and the model stops. A violation ends the call with
`content_policy_violation`, is counted on the request's record, and is logged without the
text (at most one line a second per tenant and rule).
"""

from __future__ import annotations

import logging
from typing import Any

from services.common.log_limit import RateLimitedLog
from services.inference.answer_reading import tool_call_pieces, tool_call_text
from services.inference.output_policy import VIOLATION, VIOLATION_CODE, OutputPolicy, Violation
from services.pipeline.state import RequestState
from services.pipeline.verdicts import Stop
from wire.v1 import generation_pb2

log = logging.getLogger("spine.gateway")
# What a flood of requests repeats: each one at DEBUG, at most one line a second per key at WARNING.
_violations = RateLimitedLog(log, "answers ended by the output policy")


class AnswerPolicing:
    """`policy` applied to answers and chunks (None: nothing is checked)."""

    def __init__(self, policy: OutputPolicy | None) -> None:
        self.policy = policy

    def answer(self, state: RequestState, response: generation_pb2.GenerateResponse) -> None:
        """A whole answer, its text and its tool calls' arguments (Stop on a violation)."""
        if self.policy is None:
            return
        calls = tool_call_text(response.body) if response.body else ""
        text = f"{response.text}\n{calls}" if calls else response.text
        found = self.policy.check(state.tenant, state.model, text, response.token_ids)
        if found is not None:
            raise self._violation(state, found)

    def stream(self, state: RequestState) -> Any:
        """The check a stream's chunks go through, in order (None: no policy)."""
        return self.policy.stream(state.tenant, state.model) if self.policy is not None else None

    def chunk(self, state: RequestState, check: Any, chunk: generation_pb2.GenerateChunk) -> None:
        """One chunk before it is released: its text and its tool-call pieces (Stop on a violation)."""
        if check is None:
            return
        calls = tool_call_pieces(chunk.events) if chunk.events else ""
        found = check.check(chunk.text + calls if calls else chunk.text, chunk.token_ids)
        if found is not None:
            raise self._violation(state, found)

    @staticmethod
    def _violation(state: RequestState, found: Violation) -> Stop:
        state.policy_violation = True
        _violations((state.tenant, found.rule), "request %s: %s: rule %r (%s), tenant %s, model %s; the answer "
                    "was ended", state.request_id, VIOLATION, found.rule, found.kind, state.tenant,
                    state.model)  # never the text
        return Stop(VIOLATION_CODE, found.details)
