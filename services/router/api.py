"""The router as its callers see it, wherever it runs: `Router`, and how its one operation
crosses the wire (`ResolveBatch`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from services.pipeline.batch_rpc import BatchRpc, ItemError, field_items, message_answer
from services.pipeline.interface import NO_OPTIONS, CallOptions, Interface
from wire.v1 import router_pb2

Route = router_pb2.ResolveResponse | ItemError


class Router(Protocol):
    """Which model a request's model name (an id or an alias) means."""

    def resolve(self, names: Sequence[str], options: CallOptions = NO_OPTIONS) -> list[Route]:
        """One route per name, in order; NOT_FOUND, naming the known models, for a name it does not know."""
        ...


_encode_names, _decode_names = field_items(router_pb2.ResolveBatchRequest, "model")
_encode_routes, _decode_routes = message_answer(router_pb2.ResolveBatchResponse)
RESOLVE_BATCH: BatchRpc[str, router_pb2.ResolveResponse, router_pb2.ResolveBatchRequest, router_pb2.ResolveBatchResponse] = BatchRpc(
    rpc="ResolveBatch", method="resolve", encode_items=_encode_names,
    decode_items=_decode_names, encode_results=_encode_routes,
    decode_results=_decode_routes)

ROUTER: Interface[Router] = Interface("router", [RESOLVE_BATCH])
