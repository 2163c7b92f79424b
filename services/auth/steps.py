"""The auth step: the pipeline asks Auth whose bearer credential each request carries."""

from __future__ import annotations

import grpc

from services.auth.api import AUTH, Auth
from services.pipeline.state import RequestState
from services.pipeline.step import Step, StepCall
from services.pipeline.verdicts import MISSING_CREDENTIAL, Stop, bearer


class AuthStep(Step[Auth]):
    """The pipeline asks Auth whose bearer credential a request carries (fail closed)."""

    interface = AUTH
    method = "Check"

    def screen(self, state: RequestState) -> Stop | None:
        if bearer(state.metadata) is None:
            return Stop(grpc.StatusCode.UNAUTHENTICATED, MISSING_CREDENTIAL)
        return None

    def decide(self, batch: list[RequestState], call: StepCall[Auth]) -> None:
        verdicts = call.component.check([bearer(state.metadata) or "" for state in batch], call.options)
        for state, verdict in self.answered(call, batch, verdicts):
            state.principal = verdict.principal
            state.tenant = state.principal.tenant
