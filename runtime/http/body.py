"""A request's body, read under the `http:` section's limits, by every HTTP server spine runs.

The HTTP API (`runtime.http.app`, the API's routes and `/admin/`) and the migration's HTTP
front (`migration.traffic.http_front`) read bodies with this one class, so a body is bounded
the same way wherever it arrives, framed by `Content-Length` or sent `Transfer-Encoding:
chunked` (uvicorn's parser undoes the chunking; the app sees the same `http.request`
messages either way):

- a declared length over `max_body_bytes` is refused 413 before a byte is read, and an
  undeclared (chunked) one the moment it passes the limit, the rest never read;
- the whole body must arrive within `read_timeout_s` of the headers' end, else 408: a
  client that declares 1000 bytes and sends one, or one a second, holds its connection (one
  of `max_connections`) for that long at most;
- the bodies being read at once, all connections together, stay under
  `max_pending_body_bytes` (503, retry shortly): what unauthenticated clients can make the
  server hold is bounded as a whole, not only per connection.

One reader per server: its pending count belongs to the server's event loop thread alone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from runtime.config.http import HttpConfig
from runtime.http.wire import HttpError

Receive = Callable[[], Awaitable[dict[str, Any]]]
CLOSE = ("connection", "close")


class BodyReader:
    """Reads bodies for one server under `config`'s limits; refusals are `HttpError`s (413,
    408, 503; 499 when the client went away)."""

    def __init__(self, config: HttpConfig) -> None:
        self.config = config
        self.pending_bytes = 0  # bodies being read, all connections (the event loop's thread alone)

    def over_limit(self) -> HttpError:
        return HttpError(413, "invalid_request_error",
                         f"the request body is over the limit of {self.config.max_body_bytes} bytes "
                         "(http.max_body_bytes)", (CLOSE,))

    async def read(self, receive: Receive, headers: Iterable[tuple[bytes, bytes]]) -> bytes:
        """The whole body of the request whose head is `headers` (raw ASGI pairs)."""
        limit = self.config.max_body_bytes
        declared = header(headers, b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            raise self.over_limit()
        chunks: list[bytes] = []
        size = 0
        deadline = time.monotonic() + self.config.read_timeout_s
        try:
            while True:
                try:
                    message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    raise HttpError(408, "invalid_request_error",
                                    f"the request body did not arrive within {self.config.read_timeout_s:g}s "
                                    "(http.read_timeout_s)", (CLOSE,)) from None
                if message["type"] == "http.disconnect":
                    raise HttpError(499, "cancelled", "the client went away")
                chunk = message.get("body", b"")
                size += len(chunk)
                self.pending_bytes += len(chunk)
                if size > limit:  # a chunked body too: refused as it passes the limit, the rest never read
                    raise self.over_limit()
                if self.pending_bytes > self.config.max_pending_body_bytes:
                    raise HttpError(503, "overloaded_error", "the server is reading as many request bodies as it "
                                    "holds at once (http.max_pending_body_bytes); retry shortly",
                                    (("retry-after", "1"), CLOSE))
                chunks.append(chunk)
                if not message.get("more_body"):
                    return b"".join(chunks)
        finally:
            self.pending_bytes -= size


def has_body(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Whether the request declares a body: a non-zero `Content-Length` or any
    `Transfer-Encoding` (chunked: its length is known only at its end)."""
    headers = list(headers)
    return header(headers, b"transfer-encoding") is not None or \
        header(headers, b"content-length") not in (None, "0")


def header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> str | None:
    """The first value of `name` (lower case) among raw ASGI header pairs."""
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None
