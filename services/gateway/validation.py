"""The gateway's own admission check: no component to ask, so it is a stage of the gateway."""

from __future__ import annotations

from services.pipeline.state import RequestState
from services.pipeline.step import Step, StepCall
from services.pipeline.verdicts import Stop, admission_stop


class ValidationStep(Step[None]):
    """Once the tenant is known: bad input (INVALID_ARGUMENT naming the field), then a
    priority above the tenant's allowance (PERMISSION_DENIED)."""

    method = "Validate"
    decides = False

    def screen(self, state: RequestState) -> Stop | None:
        assert state.principal is not None  # after the auth stage
        return admission_stop(state.request, state.principal, self.limits)

    def decide(self, batch: list[RequestState], call: StepCall) -> None:
        """Nothing to ask anyone: `screen` has decided."""
