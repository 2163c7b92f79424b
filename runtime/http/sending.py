"""Writing an answer to the ASGI server: headers encoded once, JSON bodies, a stream's
pieces under the client's read deadline, and dropping a connection that stopped reading.

Every route answers through these, so an answer's headers (`answer_headers`: request id,
layout, the spine's own headers a client may see) are the same whatever wrote it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from runtime.http.bounded_protocol import ABORT_EXTENSION
from runtime.http.wire import HttpError, answer_headers

Scope = dict[str, Any]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def encode(headers: Iterable[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    return [(key.encode("latin-1"), value.encode("latin-1")) for key, value in headers]


async def send_json(send: Send, status: int, body: bytes, trailing: Iterable[tuple[str, str]],
                     extra: Iterable[tuple[str, str]] = ()) -> None:
    headers = [("content-type", "application/json"), *answer_headers(trailing), *extra]
    await send({"type": "http.response.start", "status": status, "headers": encode(headers)})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_body(send: Send, body: bytes, more: bool, within_s: float) -> bool:
    """One piece of a stream's body; False when the client took none of what the connection
    holds within `within_s` (uvicorn's `send` waits while its write buffer is full)."""
    try:
        await asyncio.wait_for(send({"type": "http.response.body", "body": body, "more_body": more}), within_s)
    except TimeoutError:
        return False
    return True


def abort_of(scope: Scope) -> Callable[[], None]:
    """How to drop the request's connection at once (the server's protocol puts it in the
    scope's extensions; without it, nothing more is done)."""
    abort: Callable[[], None] | None = scope.get("extensions", {}).get(ABORT_EXTENSION)
    return abort if abort is not None else (lambda: None)


async def send_error(send: Send, api: Any, error: HttpError, trailing: Iterable[tuple[str, str]],
                      request_id: str) -> None:
    if error.status == 499:  # nobody is listening
        return
    await send_json(send, error.status, api.error_body(error, request_id), trailing, error.headers)
