"""A component's batch rpc as the pipeline calls it: plain items in, one result per item out.

Why: in the spine a step calls its component in-process. Building the batch request
message, reading the batch answer back, and a call context for a call that never leaves
the thread cost more than the decisions themselves (a request at concurrency 1 arrives on
a core the model's step has left cold: every distinct object and C library it touches is
a cache miss). So a step speaks plain values, and the wire is a codec around the same
decision:

- in-process (`runtime.placement.in_process`): the servicer's method (the interface's operation,
  `method`) is called with the items and returns the results;
- over the wire (`runtime.placement.remote`): the items are encoded into the rpc's request, the rpc
  is called, and its answer decoded into the same results;
- serving the rpc (`serve`): the servicer decodes the request into items, decides them
  with that same method, and encodes the results.

So both layouts run one decision path and the proto stays the contract: the remote path
is `decode_results ∘ rpc ∘ encode_items`, and the rpc is `encode_results ∘ method ∘
decode_items`. A failed item is an `ItemError` (its status in the batch answer), never an
exception: the other items of the batch are still answered.

The items a step builds (`AdmitItem`, `StoreItem`, `LogEntry`, `MetricsRecord`) are
slotted dataclasses but not frozen ones: one is made per request per step, read once and
dropped, and a frozen dataclass's generated `__init__` costs several times a plain one's
(each field goes through `object.__setattr__`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import grpc

from services.common import set_status, status_code
from wire.v1 import batch_pb2

Item = TypeVar("Item")
Result = TypeVar("Result")
Request = TypeVar("Request")  # the rpc's request message
Answer = TypeVar("Answer")  # the rpc's answer message


class _Results(Protocol):
    """A batch answer message: its `results`, one per item."""

    @property
    def results(self) -> Any: ...


class _Records(Protocol):
    """A write's batch request message: its `records`, one per item."""

    @property
    def records(self) -> Any: ...


Answered = TypeVar("Answered", bound=_Results)
Written = TypeVar("Written", bound=_Records)


@dataclass(frozen=True, slots=True)
class ItemError:
    """One item's failure: the status its per-request rpc would end with."""

    code: grpc.StatusCode
    message: str


class StatusError(grpc.RpcError):
    """A call that ends with a status, raised where no real stub is (the shape of the error
    one raises): a servicer's plain method whose whole call failed (say, a log shutting
    down) — `serve` ends the rpc with its code, and an in-process caller sees it as it is —
    and a call translated to another protocol (`services.pipeline.envoy_calls`)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Any:
        return ()

    def initial_metadata(self) -> Any:
        return ()


@dataclass(frozen=True)
class BatchRpc(Generic[Item, Result, Request, Answer]):
    """A batch rpc and its codec (see the module docstring)."""

    rpc: str  # the proto's batch method, e.g. "CheckBatch"
    method: str  # the interface's operation on plain items, e.g. "check"
    encode_items: Callable[[Sequence[Item]], Request]  # caller: items -> the rpc's request
    decode_items: Callable[[Request], list[Item]]  # servicer: the rpc's request -> items
    encode_results: Callable[[Sequence[Result | ItemError]], Answer]  # servicer: results -> the rpc's answer
    decode_results: Callable[[Answer], list[Result | ItemError]]  # caller: the rpc's answer -> results

    def serve(self, servicer: object, request: Request, context: Any = None) -> Answer:
        """The rpc's answer to `request`, decided by `servicer`'s operation; a
        `StatusError` ends the call with its code (raised as is without a context)."""
        try:
            return self.encode_results(getattr(servicer, self.method)(self.decode_items(request)))
        except StatusError as error:
            if context is None:
                raise
            context.abort(error.code(), error.details())
            raise  # not reached: abort raises


def encode_answer(answer: Answered, results: Sequence[Any], fill: Callable[[Any, Any], None]) -> Answered:
    """`answer` (a batch answer message) with one item per result: an `ItemError` as the
    item's status, anything else written into the item's response by `fill(response, result)`."""
    for result in results:
        item = answer.results.add()
        if isinstance(result, ItemError):
            set_status(item.status, result.code, result.message)
        else:
            fill(item.response, result)
    return answer


def decode_answer(answer: Any, read: Callable[[Any], Any]) -> list[Any]:
    """A batch answer's results: an item's status as an `ItemError`, else `read(response)`."""
    return [ItemError(status_code(item.status.code), item.status.message) if item.status.code
            else read(item.response) for item in answer.results]


def _same(response: Any) -> Any:
    return response


def _copy_into(response: Any, result: Any) -> None:
    response.CopyFrom(result)


def message_answer(answer_type: Callable[[], Any]) -> tuple[Callable[[Sequence[Any]], Any], Callable[[Any], list[Any]]]:
    """(encode_results, decode_results) for results that are the response messages themselves."""
    return (lambda results: encode_answer(answer_type(), results, _copy_into),
            lambda answer: decode_answer(answer, _same))


def field_items(request_type: Callable[[], Any], field: str) -> tuple[Callable[[Sequence[Any]], Any],
                                                                     Callable[[Any], list[Any]]]:
    """(encode_items, decode_items) for items that are one field of the rpc's request item."""
    def encode(items: Sequence[Any]) -> Any:
        request = request_type()
        for value in items:
            request.items.add(**{field: value})
        return request
    return encode, lambda request: [getattr(item, field) for item in request.items]


def item_status(result: ItemError | None) -> batch_pb2.ItemStatus:
    """A result that is only a status (a log line, a metrics record) as its batch answer's item."""
    status = batch_pb2.ItemStatus()
    if result is not None:
        set_status(status, result.code, result.message)
    return status


def item_errors(answer: Any) -> list[ItemError | None]:
    """The results of a batch answer whose items are bare statuses (`results`): None for OK."""
    return [ItemError(status_code(status.code), status.message) if status.code else None
            for status in answer.results]


def status_only(rpc: str, method: str, encode_items: Callable[[Sequence[Item]], Written],
                answer_type: Callable[..., Answer]) -> BatchRpc[Item, None, Written, Answer]:
    """A write's batch rpc (log lines, metrics records): the servicer reads the request's
    `records` as they are (the same fields as the items) and answers each with its status."""
    return BatchRpc(rpc=rpc, method=method, encode_items=encode_items,
                    decode_items=lambda request: list(request.records),
                    encode_results=lambda results: answer_type(results=[item_status(r) for r in results]),
                    decode_results=item_errors)
