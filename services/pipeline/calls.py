"""What the pipeline calls through: a component's client (its binding) and the hooks around a call.

One hook interface for both places a call is made: the pipeline runs the hooks once per
request around a batch call (`Pipeline`), a binding runs them around a call made outside the
pipeline (the model's stream, an admin rpc). A tracing hook, a fault hook and a test's
recorder implement it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import grpc

from services.pipeline.batch_rpc import BatchRpc, ItemError

Metadata = Sequence[tuple[str, str]]


class Hook(Protocol):
    """Runs around each call of a component (spans, faults).

    `begin` may add metadata (trace context) to the list it is given and may raise a
    `grpc.RpcError` to fail the call before it is made (fault injection); its return value
    is handed back to `end`."""

    def begin(self, component: str, method: str, metadata: list[tuple[str, str]]) -> Any: ...

    def end(self, token: Any, code: grpc.StatusCode) -> None: ...


class Client(Protocol):
    """A component as a step reaches it: a unary rpc by name, or a batch rpc on plain items.

    Both run without the hooks (the pipeline runs them per request) and raise
    `grpc.RpcError` as the wire would; `runtime.bindings` has the two placements."""

    def invoke(self, method: str, request: Any, *, timeout: float | None = None,
               metadata: Metadata | None = None) -> Any: ...

    def call_batch(self, rpc: BatchRpc[Any, Any], items: Sequence[Any], *, timeout: float | None = None,
                   metadata: Metadata | None = None) -> list[Any | ItemError]: ...
