"""The hooks around a call of a component (spans, injected faults).

They run in one place, the pipeline (`services.pipeline.pipeline`): once per request around
a step's batch call, and around a call the gateway makes outside a batch (the model's,
`Pipeline.begin_call`) — the same way whatever the component's placement. A tracing hook,
a fault hook and a test's recorder implement it.
"""

from __future__ import annotations

from typing import Any, Protocol

import grpc


class Hook(Protocol):
    """Runs around each call of a component (spans, faults).

    `begin` may add metadata (trace context) to the list it is given and may raise a
    `grpc.RpcError` to fail the call before it is made (fault injection); its return value
    is handed back to `end`. A hook whose `may_block` is False (an attribute; without one a
    hook is taken to block) never waits in `begin` or `end`, so calls may run on an event
    loop while it is installed."""

    def begin(self, component: str, method: str, metadata: list[tuple[str, str]]) -> Any: ...

    def end(self, token: Any, code: grpc.StatusCode) -> None: ...
