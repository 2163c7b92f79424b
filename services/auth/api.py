"""The auth component as its callers see it, wherever it runs: `Auth`, and how its one
operation crosses the wire (`CheckBatch`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from services.pipeline.batch_rpc import BatchRpc, ItemError, field_items, message_answer
from services.pipeline.interface import NO_OPTIONS, CallOptions, Interface
from wire.v1 import auth_pb2

CheckVerdict = auth_pb2.CheckResponse | ItemError


class Auth(Protocol):
    """Whose bearer credentials these are."""

    def check(self, credentials: Sequence[str], options: CallOptions = NO_OPTIONS) -> list[CheckVerdict]:
        """One verdict per credential, in order: its principal, or that item's denial
        (UNAUTHENTICATED, PERMISSION_DENIED)."""
        ...


_encode_checks, _decode_checks = field_items(auth_pb2.CheckBatchRequest, "credential")
_encode_verdicts, _decode_verdicts = message_answer(auth_pb2.CheckBatchResponse)
CHECK_BATCH: BatchRpc[str, auth_pb2.CheckResponse, auth_pb2.CheckBatchRequest, auth_pb2.CheckBatchResponse] = BatchRpc(
    rpc="CheckBatch", method="check", encode_items=_encode_checks,
    decode_items=_decode_checks, encode_results=_encode_verdicts, decode_results=_decode_verdicts)

AUTH: Interface[Auth] = Interface("auth", [CHECK_BATCH])
