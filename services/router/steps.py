"""The router step: the pipeline asks the Router which model each request names."""

from __future__ import annotations

from services.pipeline.batch_rpc import BatchRpc, field_items, message_answer
from services.pipeline.state import RequestState
from services.pipeline.step import Step, StepCall
from services.pipeline.verdicts import resolved_request
from wire.v1 import router_pb2

_encode_names, _decode_names = field_items(router_pb2.ResolveBatchRequest, "model")
_encode_routes, _decode_routes = message_answer(router_pb2.ResolveBatchResponse)
RESOLVE_BATCH: BatchRpc[str, router_pb2.ResolveResponse] = BatchRpc(
    rpc="ResolveBatch", local="resolve_items", encode_items=_encode_names,
    decode_items=_decode_names, encode_results=_encode_routes,
    decode_results=_decode_routes)


class RouterStep(Step):
    """The pipeline asks the Router which model a request's id or alias names (fail closed)."""

    method = "Resolve"

    def decide(self, batch: list[RequestState], call: StepCall) -> None:
        routes = call.batch(RESOLVE_BATCH, [state.request.model for state in batch])
        for state, route in self.answered(call, batch, routes):
            state.model = route.model_id
            state.resolved = resolved_request(state.request, state.model)
            state.fallback, state.fallback_of = route.fallback, tuple(route.fallback_of)
