"""Serving `spine.v1.Gateway` over gRPC so that a body that does not decode is bad input.

gRPC's own answer to a request body it cannot parse is INTERNAL with no trailers and a
traceback logged for every such request: a flood of garbage would fill the log and look like
the server's fault. Here the body is parsed leniently and refused by the handler like any bad
input — INVALID_ARGUMENT, the usual trailers, one summarised log line.
"""

from __future__ import annotations

import logging
from typing import Any

import grpc

from services.common.log_limit import RateLimitedLog
from services.gateway.request_ids import REQUEST_ID_HEADER, safe_request_id
from wire.v1 import generation_pb2

LAYOUT_HEADER = "x-spine-layout"

log = logging.getLogger("spine.gateway")
_undecodable = RateLimitedLog(log, "undecodable request bodies")


class Undecodable:
    """A request body that is not a GenerateRequest: handed to the handler instead of gRPC's
    own failure (INTERNAL, no trailers, a traceback logged for every such request)."""

    def __init__(self, size: int) -> None:
        self.size = size


def _lenient(parse: Any) -> Any:
    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception:  # google.protobuf.message.DecodeError, or anything a parser raises
            return Undecodable(len(data))
    return deserialize


def _refusing(servicer: Any, behaviour: Any, streaming: bool) -> Any:
    """`behaviour`, but an undecodable body is INVALID_ARGUMENT with the usual trailers."""
    def refuse(request: Undecodable, context: Any) -> None:
        md = dict(context.invocation_metadata() or ())
        request_id = safe_request_id(md.get(REQUEST_ID_HEADER))
        _undecodable(None, "request %s: a %d-byte body that is not a spine.v1.GenerateRequest, refused",
                     request_id, request.size)
        context.set_trailing_metadata(((LAYOUT_HEADER, str(getattr(servicer, "layout", "front"))),
                                       (REQUEST_ID_HEADER, request_id)))
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"request body ({request.size} bytes) is not a valid spine.v1.GenerateRequest")

    if streaming:
        def handle_stream(request: Any, context: Any) -> Any:
            if isinstance(request, Undecodable):
                refuse(request, context)
            yield from behaviour(request, context)
        return handle_stream

    def handle(request: Any, context: Any) -> Any:
        if isinstance(request, Undecodable):
            refuse(request, context)
        return behaviour(request, context)
    return handle


def add_gateway_to_server(servicer: Any, server: Any) -> None:
    """Serve `spine.v1.Gateway` (the gateway's or the front's) so that a body that does not
    decode is answered like any bad input, not by gRPC's own INTERNAL."""
    parse = _lenient(generation_pb2.GenerateRequest.FromString)
    handlers = {
        "Generate": grpc.unary_unary_rpc_method_handler(
            _refusing(servicer, servicer.Generate, streaming=False), request_deserializer=parse,
            response_serializer=generation_pb2.GenerateResponse.SerializeToString),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            _refusing(servicer, servicer.GenerateStream, streaming=True), request_deserializer=parse,
            response_serializer=generation_pb2.GenerateChunk.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("spine.v1.Gateway", handlers),))
