"""How bytes reach an upstream: aiohttp for HTTP/1.1, httpx2 where HTTP/2 can be negotiated.

Two well-kept async clients, each where it is the better one, behind one small shape
(`Transport.post` → a `Reply` with a status, headers, a bounded read and the body's pieces):

- **aiohttp** (`http://` upstreams, and `https://` ones with `http2: false`): connection pool
  per upstream, keep-alive, its C HTTP parser. Chosen by measurement: on this project's
  2-core host a request through it cost a third to a half of httpx2's client CPU
  (~0.3-0.5 ms against ~0.8-1.1 ms, the same upstream, interleaved), and the spine's whole
  overhead budget over the model is about a millisecond. It speaks only HTTP/1.1.
- **httpx2** (`https://` upstreams with `http2: true`, the default): HTTP/2 offered by ALPN
  and used where the upstream accepts it (one connection multiplexing every request), else
  HTTP/1.1 on the same client. The maintained continuation of httpx (the `openai` and
  `anthropic` SDKs use it).

Each keeps one pool per event loop that calls it (`services.common.loop_bound`): a pool is
its loop's, so the HTTP front's loop, which awaits an upstream itself, and the process's
upstream loop, which blocking callers hand their calls to, each have their own.

Neither reads proxies or certificates from the environment (`trust_env=False`): a request
goes to exactly the configured URL, verified against the system's roots or `ca_file`.
Every failure of the link comes out as `LinkError` with the kind it is (`failures.Kind`).
"""

from __future__ import annotations

import contextlib
import re
import ssl
from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

from services.common.loop_bound import PerLoop
from services.common.upstream_config import UpstreamSpec
from services.inference.upstream.failures import Kind


class LinkError(Exception):
    """The link to the upstream failed: `kind` is UNREACHABLE, TIMEOUT or MALFORMED."""

    def __init__(self, kind: Kind, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


class Reply(Protocol):
    status: int
    headers: Mapping[str, str]  # case-insensitive

    async def read(self, limit: int) -> bytes: ...
    def pieces(self) -> AsyncIterator[bytes]: ...


class Transport(Protocol):
    """One upstream's connection pool."""

    def post(self, url: str, headers: Mapping[str, str], body: bytes,
             timeout_s: float) -> contextlib.AbstractAsyncContextManager[Reply]: ...
    async def aclose(self) -> None: ...


def ssl_context(spec: UpstreamSpec) -> ssl.SSLContext | None:
    """The verifying context for an https upstream (its `ca_file`, else the system's roots)."""
    if not spec.base_url.startswith("https:"):
        return None
    context = ssl.create_default_context(cafile=str(spec.ca_file) if spec.ca_file is not None else None)
    if spec.http2:
        context.set_alpn_protocols(["h2", "http/1.1"])
    return context


def transport_for(spec: UpstreamSpec) -> Transport:
    if spec.http2 and spec.base_url.startswith("https:"):
        return Httpx2Transport(spec)
    return AiohttpTransport(spec)


async def _bounded(pieces: AsyncIterator[bytes], limit: int) -> bytes:
    out = bytearray()
    async for piece in pieces:
        out += piece
        if len(out) >= limit:
            break
    return bytes(out[:limit])


# -- aiohttp ----------------------------------------------------------------------------------
class _AiohttpReply:
    def __init__(self, response: Any) -> None:
        self._response = response
        self.status = int(response.status)
        self.headers = response.headers

    async def read(self, limit: int) -> bytes:
        return await _bounded(self.pieces(), limit)

    async def pieces(self) -> AsyncIterator[bytes]:
        async for piece in self._response.content.iter_any():
            yield piece


class AiohttpTransport:
    def __init__(self, spec: UpstreamSpec) -> None:
        self.spec = spec
        # A session per event loop that calls this upstream, made on it (`loop_bound`).
        self._sessions: PerLoop[Any] = PerLoop(self._new_session, lambda session: session.close())

    def _new_session(self) -> Any:
        import aiohttp

        connector = aiohttp.TCPConnector(limit=self.spec.max_connections, limit_per_host=0,
                                         keepalive_timeout=30.0, ssl=ssl_context(self.spec) or True)
        return aiohttp.ClientSession(connector=connector, trust_env=False, auto_decompress=False,
                                     raise_for_status=False)

    def _client(self) -> Any:
        return self._sessions.get()

    @contextlib.asynccontextmanager
    async def post(self, url: str, headers: Mapping[str, str], body: bytes, timeout_s: float) -> AsyncIterator[Reply]:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=None, connect=min(self.spec.connect_timeout_s, timeout_s),
                                        sock_read=timeout_s)
        try:
            async with self._client().post(url, data=body, headers=headers, timeout=timeout,
                                           allow_redirects=False) as response:
                yield _AiohttpReply(response)
        except TimeoutError as error:
            raise LinkError(Kind.TIMEOUT, type(error).__name__) from None
        except aiohttp.ClientPayloadError as error:  # a body cut short: the connection broke
            raise LinkError(Kind.UNREACHABLE, f"the answer was cut short ({error})") from None
        except aiohttp.ClientResponseError as error:  # a reply that is not HTTP
            raise LinkError(Kind.MALFORMED, f"{type(error).__name__}: {error.message}") from None
        except (aiohttp.ClientError, OSError) as error:
            raise LinkError(Kind.UNREACHABLE, f"{type(error).__name__}: {error or 'closed'}") from None

    async def aclose(self) -> None:
        await self._sessions.aclose()


# -- httpx2 -----------------------------------------------------------------------------------
class _Httpx2Reply:
    def __init__(self, response: Any) -> None:
        self._response = response
        self.status = int(response.status_code)
        self.headers = response.headers

    async def read(self, limit: int) -> bytes:
        return await _bounded(self.pieces(), limit)

    def pieces(self) -> AsyncIterator[bytes]:
        return self._response.aiter_bytes()  # type: ignore[no-any-return]


class Httpx2Transport:
    def __init__(self, spec: UpstreamSpec) -> None:
        self.spec = spec
        self._clients: PerLoop[Any] = PerLoop(self._new_client, lambda client: client.aclose())

    def _new_client(self) -> Any:
        import httpx2

        spec = self.spec
        return httpx2.AsyncClient(
            http2=True, trust_env=False, verify=ssl_context(spec) or True,
            limits=httpx2.Limits(max_connections=spec.max_connections,
                                 max_keepalive_connections=spec.max_connections, keepalive_expiry=30.0),
            timeout=httpx2.Timeout(spec.timeout_s, connect=spec.connect_timeout_s))

    def _client(self) -> Any:
        return self._clients.get()

    @contextlib.asynccontextmanager
    async def post(self, url: str, headers: Mapping[str, str], body: bytes, timeout_s: float) -> AsyncIterator[Reply]:
        import httpx2

        timeout = httpx2.Timeout(timeout_s, connect=min(self.spec.connect_timeout_s, timeout_s))
        try:
            async with self._client().stream("POST", url, content=body, headers=dict(headers),
                                             timeout=timeout) as response:
                yield _Httpx2Reply(response)
        except httpx2.TimeoutException as error:
            raise LinkError(Kind.TIMEOUT, type(error).__name__) from None
        except httpx2.DecodingError as error:
            raise LinkError(Kind.MALFORMED, f"an undecodable body: {error}") from None
        except httpx2.HTTPError as error:
            raise LinkError(Kind.UNREACHABLE, f"{type(error).__name__}: {error or 'closed'}") from None

    async def aclose(self) -> None:
        await self._clients.aclose()


class NoEvents(ValueError):
    """A stream sent more bytes than its bound without completing one event."""


_LINE_END = re.compile(rb"\r\n|\r|\n")


class SSEParser:
    """Server-sent events from a byte stream, as the HTML standard reads them: `event:` and
    `data:` lines up to a blank line (CR, LF or CRLF), comments skipped, one event at most
    `max_bytes` (past it the stream is malformed).

    Linear in the bytes fed: each byte is searched once (a new piece is searched from where
    the last search stopped) and the consumed part of the buffer is dropped without copying
    the rest (a bytearray's front is released in place). What makes no event — blank lines
    with no data before them, comments, unknown fields — is counted: past `max_idle_bytes`
    of it since the last event, `NoEvents` (an upstream streaming nothing but blank lines is
    cut off after a bounded amount of work; keep-alive comments are a few bytes a second)."""

    def __init__(self, max_bytes: int, max_idle_bytes: int = 64 << 10) -> None:
        self.max_bytes = max_bytes
        self.max_idle_bytes = max_idle_bytes
        self._buffer = bytearray()
        self._searched = 0  # the buffer holds no line end before this
        self._event = ""
        self._data: list[str] = []
        self._size = 0  # bytes of the event being read
        self._idle = 0  # bytes that made no event since the last one

    def feed(self, piece: bytes) -> list[tuple[str, str]]:
        """The events completed by `piece`, as (name, data); ValueError past the size bound,
        `NoEvents` past the bound on bytes without an event."""
        buffer = self._buffer
        buffer += piece
        events: list[tuple[str, str]] = []
        start = 0
        end = len(buffer)
        resume, self._searched = self._searched, end
        for found in _LINE_END.finditer(buffer, resume):
            at, after = found.span()
            if after == end and buffer[at] == 0x0D and after - at == 1:
                self._searched = at  # a CR at the end may be a CRLF's first half
                break
            if at == start:  # a blank line
                if self._data:
                    events.append((self._event or "message", "\n".join(self._data)))
                    self._idle = 0
                else:
                    self._idle += after - start
                self._event, self._data, self._size = "", [], 0
                start = after
                continue
            line = buffer[start:at].decode("utf-8", "replace")
            start = after
            self._size += len(line)
            if self._size > self.max_bytes:
                raise ValueError(f"a server-sent event over {self.max_bytes} bytes")
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "event":
                self._event = value
            elif field == "data":
                self._data.append(value)
            else:  # a comment, or a field that makes no event
                self._idle += len(line)
        del buffer[:start]
        self._searched -= start
        if len(buffer) + self._size > self.max_bytes:
            raise ValueError(f"a server-sent event over {self.max_bytes} bytes")
        if self._idle > self.max_idle_bytes:
            raise NoEvents(f"sent {self._idle} bytes without an event (at most {self.max_idle_bytes})")
        return events
