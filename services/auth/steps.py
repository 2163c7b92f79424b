"""The auth step: the pipeline asks Auth whose bearer credential each request carries."""

from __future__ import annotations

import grpc

from services.pipeline.batch_rpc import BatchRpc, field_items, message_answer
from services.pipeline.state import RequestState
from services.pipeline.step import Step, StepCall
from services.pipeline.verdicts import MISSING_CREDENTIAL, Stop, bearer
from wire.v1 import auth_pb2

_encode_checks, _decode_checks = field_items(auth_pb2.CheckBatchRequest, "credential")
_encode_verdicts, _decode_verdicts = message_answer(auth_pb2.CheckBatchResponse)
CHECK_BATCH: BatchRpc[str, auth_pb2.CheckResponse] = BatchRpc(
    rpc="CheckBatch", local="check_items", encode_items=_encode_checks,
    decode_items=_decode_checks, encode_results=_encode_verdicts, decode_results=_decode_verdicts)


class AuthStep(Step):
    """The pipeline asks Auth whose bearer credential a request carries (fail closed)."""

    method = "Check"

    def screen(self, state: RequestState) -> Stop | None:
        if bearer(state.metadata) is None:
            return Stop(grpc.StatusCode.UNAUTHENTICATED, MISSING_CREDENTIAL)
        return None

    def decide(self, batch: list[RequestState], call: StepCall) -> None:
        verdicts = call.batch(CHECK_BATCH, [bearer(state.metadata) or "" for state in batch])
        for state, verdict in self.answered(call, batch, verdicts):
            state.principal = verdict.principal
            state.tenant = state.principal.tenant
