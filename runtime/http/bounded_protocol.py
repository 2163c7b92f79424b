"""uvicorn's httptools protocol with the bounds a public listener needs before authentication.

uvicorn and httptools put no limit on a request's head: llhttp hands the header bytes over as
they come, httptools concatenates a header's fragments and uvicorn keeps every field, so one
client that streams header lines and never ends them makes the server hold all of it (tens of
megabytes a connection) until the read timeout. A connection that has not finished its head
is not counted against uvicorn's `limit_concurrency` either: that cap is looked at once the
headers are complete. This protocol bounds both, the way Envoy and nginx do:

- the head (request line and header lines) is fed to the parser only up to
  `max_header_bytes`; past it the request is answered 431 and nothing more is buffered;
- a header line longer than `max_header_line_bytes`, or more than `max_header_fields`
  fields, is answered 431; a request line longer than the line limit 414;
- a connection past `max_connections` is answered 503 the moment it is accepted, and is not
  counted as one of them while it closes; every connection within the cap is served (uvicorn's
  own `limit_concurrency`, which refuses every request once the connections reach it, is off:
  the cap at accept bounds the requests too, one at a time on each connection);
- a head that does not arrive within `read_timeout_s` closes its connection (slowloris).

A refused connection is closed the way nginx's lingering close does it: the answer is
written, the write side shut, and whatever the client still sends is read and thrown away
for at most `LINGER_S` seconds or `LINGER_BYTES` bytes. Closing at once would make the
kernel answer the client's unread bytes with a reset, which can destroy the 4xx before the
client reads it.

What a connection can make the server hold is therefore its head (at most
`max_header_bytes` as received, about as much again as the fields uvicorn keeps) plus one
read of the event loop (`READ_CHUNK_BYTES`, transient) plus the body the app reads
(`runtime.http.body`, at most `max_body_bytes`, and all bodies together at most
`max_pending_body_bytes`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from runtime.config.http import HttpConfig

log = logging.getLogger("spine.http")
# The scope's extension the app calls to drop a connection at once (a stream whose client
# stopped reading: what the socket still holds goes with it, rather than waiting to be read).
ABORT_EXTENSION = "spine.abort_connection"

LINGER_S = 1.0  # a refused connection is drained this long at most, then closed
LINGER_BYTES = 4 << 20  # ... or until this much has been thrown away
READ_CHUNK_BYTES = 256 << 10  # uvloop's read buffer: the most one data_received hands over

# (status, message, path) -> the whole HTTP response, in the API's error shape.
Refusal = Callable[[int, str, str], bytes]


class HeadRefused(Exception):
    """Raised from a parser callback to stop parsing: the request's head is past a limit."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def plain_refusal(status: int, message: str, path: str) -> bytes:
    """A response for a server that has no app to shape it (tests, a bare listener)."""
    return response_bytes(status, message.encode(), "text/plain; charset=utf-8", ())


def response_bytes(status: int, body: bytes, content_type: str, headers: tuple[tuple[str, str], ...]) -> bytes:
    """One complete HTTP/1.1 response that closes its connection."""
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", f"content-type: {content_type}",
             f"content-length: {len(body)}", "connection: close",
             *(f"{name}: {value}" for name, value in headers)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class BoundedHttpProtocol(HttpToolsProtocol):
    """HttpToolsProtocol with a bounded request head, a connection cap at accept, a deadline
    for the head and a lingering close for refusals. Configured per server by `bounded_protocol`."""

    limits: HttpConfig = HttpConfig()
    refusal: Refusal = staticmethod(plain_refusal)

    _head_timer: asyncio.TimerHandle | None = None
    _reading_head = True  # between a message's end (or the connection's start) and its headers' end
    _head_bytes = 0
    _fields = 0
    _draining = False  # refused: what the client still sends is thrown away
    _refusal_due: bytes | None = None  # a pipelined refusal, written once the answer in progress is
    _lingering = False  # the write side is shut and the connection closes soon
    # uvicorn's own per-connection records, as its base class types them (set there).
    cycle: RequestResponseCycle
    server_state: ServerState
    _discarded = 0

    # -- the connection ----------------------------------------------------------------
    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            # Not one of the connections served: its lingering close must not count against
            # the cap, or a burst of refusals would refuse the next connections in the cap too.
            self.connections.discard(self)
            self._refuse(503, f"the server holds its limit of {self.limits.max_connections} connections; "
                              "retry shortly")
            return
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._draining:
            self._discard(len(data))
            return
        if self._reading_head:
            room = self.limits.max_header_bytes - self._head_bytes
            if len(data) > room:  # feed the head up to its limit; the rest only if the head ended there
                view = memoryview(data)
                self._head_bytes += max(room, 0)
                if room > 0 and not self._feed(view[:room]):
                    return
                if self._reading_head:
                    self._refuse(431, f"the request's headers are over the limit of {self.limits.max_header_bytes} "
                                      "bytes (http.max_header_bytes)")
                    return
                self.data_received(bytes(view[room:]))
                return
            self._head_bytes += len(data)
        self._feed(data)

    def _feed(self, data: bytes | memoryview) -> bool:
        """Parse `data` as uvicorn does; False when the connection was refused or closed."""
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        except httptools.HttpParserError as error:
            refused = error.__context__
            if isinstance(refused, HeadRefused):
                self._refuse(refused.status, refused.message)
            else:
                self.send_400_response("Invalid HTTP request received.")
            return False
        return not self.transport.is_closing()

    # -- the parser's callbacks ----------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._fields = 0
        if self._head_timer is None:
            self._arm()

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        if len(self.url) > self.limits.max_header_line_bytes:
            raise HeadRefused(414, f"the request line is over the limit of {self.limits.max_header_line_bytes} "
                                   "bytes (http.max_header_line_bytes)")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._fields += 1
        if self._fields > self.limits.max_header_fields:
            raise HeadRefused(431, f"the request has more than {self.limits.max_header_fields} header fields "
                                   "(http.max_header_fields)")
        if len(name) + len(value) + 4 > self.limits.max_header_line_bytes:
            raise HeadRefused(431, f"the header {name[:64].decode('latin-1')!r} is over the limit of "
                                   f"{self.limits.max_header_line_bytes} bytes a line (http.max_header_line_bytes)")
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._disarm()
        self._reading_head = False
        self._head_bytes = 0
        super().on_headers_complete()
        if self.cycle is not None:  # the app's answer closes through us: see LingeringClose
            self.cycle.transport = LingeringClose(self)  # type: ignore[assignment]
            extensions: dict[str, Any] = self.cycle.scope.setdefault("extensions", {})
            extensions[ABORT_EXTENSION] = self.transport.abort

    def on_message_complete(self) -> None:
        self._reading_head = True
        super().on_message_complete()

    def on_response_complete(self) -> None:
        if self._refusal_due is not None and not self.pipeline:  # the requests before it are answered
            self.server_state.total_requests += 1
            self.transport.write(self._refusal_due)
            self._refusal_due = None
            self._linger()
            return
        if self._draining and self._refusal_due is None:  # closing: no keep-alive timer
            self.server_state.total_requests += 1
            return
        super().on_response_complete()

    # -- refusing --------------------------------------------------------------------------
    def _refuse(self, status: int, message: str) -> None:
        """Answer `status` and close the connection, draining what the client still sends.
        Behind a pipelined request still being answered, the refusal waits for that answer."""
        self._disarm()
        if self._draining or self.transport.is_closing():
            return
        log.debug("refusing a request from %s: %s %s", self.client, status, message)
        url = getattr(self, "url", b"")  # none before the first request began
        refusal = self.refusal(status, message, url.split(b"?", 1)[0].decode("latin-1", "replace"))
        self.headers = []  # what was parsed of the head is not kept while draining
        self._draining = True
        if self.cycle is not None and not self.cycle.response_complete:
            self._refusal_due = refusal
            return
        self.transport.write(refusal)
        self._linger()

    def close_after_answer(self) -> None:
        """The app answered and the connection is not kept alive: close it, lingering when
        the request's body is still arriving (a 413 or 408 before the whole body was read)."""
        if self.cycle is not None and self.cycle.more_body and not self.transport.is_closing():
            self._draining = True
            self._linger()
        else:
            self.transport.close()

    def _linger(self) -> None:
        """Shut the write side, throw away what the client still sends, close soon."""
        if self._lingering:
            return
        self._lingering = True
        if self.cycle is not None:
            self.cycle.body = bytearray()
        self.flow.resume_reading()  # the body's flow control may have paused it: drain instead
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)

    def _discard(self, size: int) -> None:
        self._discarded += size
        if self._discarded <= LINGER_BYTES:
            return
        if self._lingering:
            self.transport.close()
        else:  # an answer is still being written: stop reading until it is
            self.flow.pause_reading()

    # -- the head's deadline -------------------------------------------------------------
    def _arm(self) -> None:
        self._head_timer = self.loop.call_later(self.limits.read_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _too_slow(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            log.debug("closing a connection from %s: its request headers took over %gs",
                      self.client, self.limits.read_timeout_s)
            self.transport.close()


class LingeringClose:
    """The transport as a request's response cycle sees it: uvicorn closes a connection that
    is not kept alive the moment the answer is written, which resets it if the client is
    still sending its body; closing through the protocol drains it first."""

    def __init__(self, protocol: BoundedHttpProtocol) -> None:
        self._protocol = protocol
        self._transport = protocol.transport

    def close(self) -> None:
        self._protocol.close_after_answer()

    def is_closing(self) -> bool:
        return self._transport.is_closing() or self._protocol._draining

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def bounded_protocol(limits: HttpConfig, refusal: Refusal = plain_refusal) -> type[BoundedHttpProtocol]:
    """The protocol class uvicorn is given (`http=`): it builds each connection's protocol
    itself, so the limits travel as class attributes of a class of this server's own."""
    return type("BoundedHttp", (BoundedHttpProtocol,), {"limits": limits, "refusal": staticmethod(refusal)})
