"""A stream's answer written to the client as server-sent events, from whichever source serves it.

The source is either the gateway's stream awaited on the HTTP loop (the spine over an
upstream) or a handler thread pumping a blocking stream through a bounded window
(`pump_stream`, `runtime.http.stream_window`); either hands the relay items one at a time: a
chunk, `END`, `GONE` (the client left) or a verdict. The relay writes what is ready in one
write, never more than a window ahead of the client, and cancels a stream whose client reads
nothing for `http.stream_stall_s` (its model stops, its connection is dropped).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from runtime.http.sending import Send, encode, send_body, send_error
from runtime.http.stream_window import LIMIT as WINDOW
from runtime.http.stream_window import StreamWindow
from runtime.http.verdicts import gateway_failed, verdict_of, with_status
from runtime.http.wire import REQUEST_ID, HttpError, answer_headers
from services.common.log_limit import RateLimitedLog
from services.pipeline.local_context import SLOW_READER, LocalContext
from services.pipeline.verdicts import USAGE_HEADER

log = logging.getLogger("spine.http")
_slow_readers = RateLimitedLog(log, "streams cancelled for a client that did not read")

Trailing = tuple[tuple[str, str], ...]
END = object()  # the stream's last chunk has been handed over
GONE = object()  # the client went away


async def relay(send: Send, api: Any, parsed: Any, context: LocalContext, base: Trailing,
                next_item: Callable[[], Awaitable[Any]], idle: Callable[[], bool],
                abort: Callable[[], None], stall_s: float) -> None:
    """The stream's items (`next_item`: a chunk, `END`, `GONE` or a verdict) to the
    client as server-sent events; what is ready is written together (`idle`: nothing more
    is waiting), never more than a window at once."""
    first = await next_item()
    trailing = (*base, *context.trailing_metadata())
    request_id = dict(trailing)[REQUEST_ID]
    if first is GONE:
        return
    if isinstance(first, HttpError):
        await send_error(send, api, with_status(first, api, trailing), trailing, request_id)
        return
    writer = api.Stream(parsed, request_id)
    writer.raw = first is not END and bool(getattr(first, "events", None)) and getattr(parsed, "chat", True)
    prompt_tokens = len(parsed.request.prompt.encode()) + len(parsed.request.system.encode())
    await send({"type": "http.response.start", "status": 200,
                "headers": encode([("content-type", "text/event-stream; charset=utf-8"),
                                    ("cache-control", "no-cache"), *answer_headers(trailing)])})
    model = first.model if first is not END else parsed.request.model
    start = writer.start(model, prompt_tokens)
    tokens, finish, item = 0, "", first
    pending = [start] if start else []
    while True:
        if item is GONE:
            return
        if item is END:
            counted_by = dict(context.trailing_metadata()).get(USAGE_HEADER, "")
            pending.append(writer.end(finish, prompt_tokens, tokens, counted_by))
            await send_body(send, b"".join(pending), False, stall_s)
            return
        if isinstance(item, HttpError):
            error = with_status(item, api, context.trailing_metadata())
            pending.append(writer.error(error, request_id))
            await send_body(send, b"".join(pending), False, stall_s)
            return
        tokens += len(item.token_ids)
        if item.completion_tokens or item.prompt_tokens:  # the model's own count (an upstream's usage)
            tokens, prompt_tokens = item.completion_tokens, item.prompt_tokens or prompt_tokens
        finish = item.finish_reason or finish
        pending.append(writer.piece(item))
        if idle() or len(pending) >= WINDOW:  # what is ready in one write; never more than a window
            if not await send_body(send, b"".join(pending), True, stall_s):
                _slow_readers(None, "request %s: the client read nothing of its stream for %gs "
                              "(http.stream_stall_s): cancelled", request_id, stall_s)
                context.cancel(SLOW_READER)  # the model stops; the request's record says why
                abort()  # what the socket still holds is dropped with the connection
                return
            pending = []
        item = await next_item()


def pump_stream(target: Any, request: Any, context: LocalContext, window: StreamWindow) -> None:
    """Every chunk of the stream to the event loop, then END or the verdict; no further than
    the window lets it (a closed window: the client left or stopped reading, so the stream is
    closed here, which stops the model)."""
    chunks: Any = ()
    try:
        chunks = target.GenerateStream(request, context)
        for chunk in chunks:
            if not window.put(chunk):
                return
        window.end(END)
    except grpc.RpcError as error:
        window.end(verdict_of(error))
    except Exception:
        window.end(gateway_failed(context.invocation_metadata()))
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
