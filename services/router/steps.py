"""The router step: the pipeline asks the Router which model each request names."""

from __future__ import annotations

from services.pipeline.state import RequestState
from services.pipeline.step import Step, StepCall
from services.pipeline.verdicts import resolved_request
from services.router.api import ROUTER, Router


class RouterStep(Step[Router]):
    """The pipeline asks the Router which model a request's id or alias names (fail closed)."""

    interface = ROUTER
    method = "Resolve"

    def decide(self, batch: list[RequestState], call: StepCall[Router]) -> None:
        routes = call.component.resolve([state.request.model for state in batch], call.options)
        for state, route in self.answered(call, batch, routes):
            state.model = route.model_id
            state.resolved = resolved_request(state.request, state.model)
            state.fallback, state.fallback_of = route.fallback, tuple(route.fallback_of)
