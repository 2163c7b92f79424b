"""A component's batch rpc as the pipeline calls it: plain items in, one result per item out.

Why: in the spine a stage calls its component in-process. Building the batch request
message, reading the batch answer back, and a call context for a call that never leaves
the thread cost more than the decisions themselves (a request at concurrency 1 arrives on
a core the model's step has left cold: every distinct object and C library it touches is
a cache miss). So a stage speaks plain values, and the wire is a codec around the same
decision:

- in-process (`LocalBinding.call_batch`): the servicer's `local` method is called with
  the items and returns the results;
- over the wire (any other binding): the items are encoded into the rpc's request, the
  rpc is called, and its answer decoded into the same results;
- serving the rpc (`serve`): the servicer decodes the request into items, decides them
  with that same `local` method, and encodes the results.

So both layouts run one decision path and the proto stays the contract: the remote path
is `decode_results ∘ rpc ∘ encode_items`, and the rpc is `encode_results ∘ local ∘
decode_items`. A failed item is an `ItemError` (its status in the batch answer), never an
exception: the other items of the batch are still answered.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc

Item = TypeVar("Item")
Result = TypeVar("Result")


@dataclass(frozen=True, slots=True)
class ItemError:
    """One item's failure: the status its per-request rpc would end with."""

    code: grpc.StatusCode
    message: str


@dataclass(frozen=True)
class BatchRpc(Generic[Item, Result]):
    """A batch rpc and its codec (see the module docstring)."""

    rpc: str  # the proto's batch method, e.g. "CheckBatch"
    local: str  # the servicer's method on plain items, e.g. "check_items"
    encode_items: Callable[[Sequence[Item]], Any]  # caller: items -> the rpc's request
    decode_items: Callable[[Any], list[Item]]  # servicer: the rpc's request -> items
    encode_results: Callable[[Sequence[Result | ItemError]], Any]  # servicer: results -> the rpc's answer
    decode_results: Callable[[Any], list[Result | ItemError]]  # caller: the rpc's answer -> results

    def serve(self, servicer: Any, request: Any) -> Any:
        """The rpc's answer to `request`, decided by `servicer`'s plain method."""
        return self.encode_results(getattr(servicer, self.local)(self.decode_items(request)))

    def over(self, client: Any, items: Sequence[Item], timeout: float | None,
             metadata: Sequence[tuple[str, str]]) -> list[Result | ItemError]:
        """The call through any client with `invoke` (a stub-shaped binding)."""
        return self.decode_results(client.invoke(self.rpc, self.encode_items(items), timeout=timeout,
                                                 metadata=metadata))
