"""The `http:` config section: where the OpenAI/Anthropic-compatible API listens, and its limits."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, StrictInt

from services.common.config_section import Float, NonEmptyStr, Section


class HttpConfig(Section):
    """The `http` section. TLS comes from the process's `tls:` section, as for every TCP listener.

    `listen` null: no HTTP listener. Every limit answers the client with a clear status
    (431 for a request head too large, 414 for a request line too long, 413 for a body too
    large, 408 for one sent too slowly, 503 past the connection cap or the server's budget for
    bodies) or closes the connection (headers not sent in time), and the process goes on
    serving the others. The head's limits apply before anything else is read, credentials
    included: they bound what an unauthenticated client can make the server hold."""

    where = "http"

    listen: NonEmptyStr | None = "127.0.0.1:8000"
    # A request body larger than this is refused with 413 before it is read.
    max_body_bytes: Annotated[StrictInt, Field(ge=1024)] = 1 << 20
    # Connections open at once; past it new requests get 503 and their connection closes.
    max_connections: Annotated[StrictInt, Field(ge=1)] = 1024
    # The request line and header lines together; past it 431, and nothing more is buffered.
    max_header_bytes: Annotated[StrictInt, Field(ge=1024)] = 64 << 10
    # One header line (name and value), and the request line (414 past it).
    max_header_line_bytes: Annotated[StrictInt, Field(ge=256)] = 8 << 10
    # Header fields in one request; past it 431.
    max_header_fields: Annotated[StrictInt, Field(ge=1)] = 100
    # The bodies being read at once, all connections together; past it 503 (retry shortly).
    max_pending_body_bytes: Annotated[StrictInt, Field(ge=1024)] = 64 << 20
    # A request's headers and its body must each arrive within this long.
    read_timeout_s: Annotated[Float, Field(gt=0)] = 10.0
    # An idle keep-alive connection is closed after this long (whole seconds: uvicorn's unit).
    keepalive_s: Annotated[StrictInt, Field(ge=1)] = 5
    # A stream whose client has taken nothing for this long (the connection's write buffer
    # full) is cancelled and its connection dropped; the server holds a bounded window of
    # it meanwhile, never the rest of the answer.
    stream_stall_s: Annotated[Float, Field(gt=0)] = 30.0
