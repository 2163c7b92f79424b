"""The `http:` config section: where the OpenAI/Anthropic-compatible API listens, and its limits."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, StrictInt

from services.common.config_section import Float, NonEmptyStr, Section


class HttpConfig(Section):
    """The `http` section. TLS comes from the process's `tls:` section, as for every TCP listener.

    `listen` null: no HTTP listener. Every limit answers the client with a clear status
    (413 for a body too large, 408 for one sent too slowly, 503 past the connection cap) or
    closes the connection (headers not sent in time), and the process goes on serving the
    others."""

    listen: NonEmptyStr | None = "127.0.0.1:8000"
    # A request body larger than this is refused with 413 before it is read.
    max_body_bytes: Annotated[StrictInt, Field(ge=1024)] = 1 << 20
    # Connections open at once; past it new requests get 503 and their connection closes.
    max_connections: Annotated[StrictInt, Field(ge=1)] = 1024
    # A request's headers and its body must each arrive within this long.
    read_timeout_s: Annotated[Float, Field(gt=0)] = 10.0
    # An idle keep-alive connection is closed after this long (whole seconds: uvicorn's unit).
    keepalive_s: Annotated[StrictInt, Field(ge=1)] = 5
