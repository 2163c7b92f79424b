"""The gateway's own admission check: no component to ask, so it is a step of the gateway."""

from __future__ import annotations

import grpc

from services.pipeline.state import RequestState
from services.pipeline.step import Step, StepCall
from services.pipeline.verdicts import Stop, admission_stop


class ValidationStep(Step[None]):
    """Once the tenant is known: bad input (INVALID_ARGUMENT naming the field), then a
    priority above the tenant's allowance (PERMISSION_DENIED)."""

    method = "Validate"
    decides = False

    def screen(self, state: RequestState) -> Stop | None:
        assert state.principal is not None  # after the auth step
        return admission_stop(state.request, state.principal, self.limits)

    def decide(self, batch: list[RequestState], call: StepCall[None]) -> None:
        """Nothing to ask anyone: `screen` has decided."""


class ModelAccessStep(Step[None]):
    """Once the router has resolved the model: a key limited to some models (a key managed at
    run time, `models`) may name only those, by an id or an alias (PERMISSION_DENIED)."""

    method = "ModelAccess"
    decides = False

    def wants(self, state: RequestState) -> bool:
        return state.open and state.principal is not None and bool(state.principal.models)

    def screen(self, state: RequestState) -> Stop | None:
        assert state.principal is not None
        allowed = state.principal.models
        if state.request.model in allowed or state.model in allowed:
            return None
        return Stop(grpc.StatusCode.PERMISSION_DENIED,
                    f"key {state.principal.subject!r} may not use model {state.request.model!r} "
                    f"(it may use: {', '.join(allowed)})")

    def decide(self, batch: list[RequestState], call: StepCall[None]) -> None:
        """Nothing to ask anyone: `screen` has decided."""
