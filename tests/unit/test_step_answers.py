"""What a step makes of its component's results, whatever shape they come in.

`Step.answered` pairs each request with its result and fails the ones whose item failed.
Results come as plain values (`call.batch`, in-process or decoded from the wire), as wire
items that carry a status (a step that calls the rpc itself), or as bare statuses. How a
type carries its status is learnt once per type (`step._status_of`), so the answer must
not depend on which shape a step sees first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

from services.pipeline.batch_rpc import ItemError
from services.pipeline.state import RequestState
from services.pipeline.step import Step
from wire.v1 import batch_pb2, ratelimit_pb2, router_pb2


class Recorder:
    """The part of `StepCall` that `answered` uses: who failed, with what."""

    def __init__(self) -> None:
        self.failed: list[tuple[str, grpc.StatusCode, str]] = []

    def fail(self, state: RequestState, code: grpc.StatusCode, message: str,
             trailing: Any = ()) -> None:
        self.failed.append((state.request_id, code, message))


@dataclass
class Verdict:
    """A plain result whose `status` is a word, not a status (it has no `code`)."""

    status: str = "fine"


def states(n: int) -> list[RequestState]:
    return [RequestState(request=None, request_id=f"r{i}", layout="test", started=0.0,  # type: ignore[arg-type]
                         deadline=1e18, shadow=False, metadata=()) for i in range(n)]


def wire_item(code: int = 0, message: str = "") -> ratelimit_pb2.ReleaseResult:
    item = ratelimit_pb2.ReleaseResult()
    item.status.code, item.status.message = code, message
    return item


def test_each_shape_of_result_is_read_for_its_status_in_any_order() -> None:
    results: list[Any] = [
        router_pb2.ResolveResponse(model_id="tiny-lm"),  # a plain message without a status field
        ItemError(grpc.StatusCode.NOT_FOUND, "unknown model"),
        wire_item(),  # a wire item: OK
        wire_item(grpc.StatusCode.PERMISSION_DENIED.value[0], "not yours"),
        batch_pb2.ItemStatus(code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message="bad"),  # a bare status
        batch_pb2.ItemStatus(),  # a bare status: OK
        None,  # a log line's or metrics record's OK
        Verdict(),
    ]
    for order in (results, list(reversed(results))):
        batch = states(len(order))
        call = Recorder()
        ok = Step.answered(call, batch, order)  # type: ignore[arg-type]
        failed = {request_id: (code, message) for request_id, code, message in call.failed}
        by_id = {state.request_id: result for state, result in zip(batch, order, strict=True)}
        assert {by_id[rid].__class__.__name__ if by_id[rid] is not None else "None" for rid in failed} == \
            {"ItemError", "ReleaseResult", "ItemStatus"}
        assert sorted(failed.values(), key=str) == sorted([
            (grpc.StatusCode.NOT_FOUND, "unknown model"),
            (grpc.StatusCode.PERMISSION_DENIED, "not yours"),
            (grpc.StatusCode.INVALID_ARGUMENT, "bad")], key=str)
        assert [result for _, result in ok] == [r for r in order if not failing(r)]
        assert len(ok) == 5


def failing(result: Any) -> bool:
    """The rule, spelt out per result (as the runner read it before it learnt it per type)."""
    status = getattr(result, "status", result)
    return isinstance(result, ItemError) or bool(getattr(status, "code", 0))
