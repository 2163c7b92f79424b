"""The HTTP front: splits OpenAI/Anthropic API traffic between a foreign legacy endpoint and the spine.

When the stack a team runs is an HTTP gateway (LiteLLM's proxy, Kong, an nginx/Envoy chain)
rather than spine's layered layout, this front takes the clients' traffic in its place and
forwards each request, bytes unchanged, to one side: the legacy endpoint or the spine's HTTP
API. As the Gateway front (`migration.traffic.front`):

- the spine gets the stage's weight, sticky on `x-session-id`, else on the client's key, so
  a conversation stays on one side while the weight holds or grows; `x-spine-route:
  legacy|spine` forces a side while the plan allows it (`route_header`); the side is chosen
  once, when a request arrives, so a weight change or a rollback never moves one in flight;
- the client's key reaches both sides unchanged: in its own header to the legacy endpoint, as
  `authorization: Bearer KEY` to the spine (whose auth is configured with the same keys:
  `spine keys import`); no `x-spine-*` header a client sends reaches either side;
- it measures each side (`OutcomeLog`): a side failed a request when it answered 5xx or not
  at all (refused, reset, timed out: the client gets 502 or 504 in its API's error shape);
  that is what the gates read where the legacy side has no metrics of its own. A legacy
  failure is the legacy side's: it is never retried on the spine, and never counted there;
- it copies a share of answered requests to the other side and compares the answers
  (`http_mirror`, `http_answers`): status class, error type, and for greedy requests the text.

Answers stream through as they come (server-sent events unbuffered); only a request picked
for a shadow copy has its answer kept, up to `MAX_KEPT_BYTES`, to be compared.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx2
import orjson

from migration.legacy_endpoint import LegacyEndpoint
from migration.traffic.http_answers import is_greedy, read_answer
from migration.traffic.http_mirror import HttpMirror, MirrorSettings
from migration.traffic.outcomes import SIDES, Outcome, OutcomeLog, SideWindow
from migration.traffic.split import ROUTE_HEADER, SESSION_HEADER, checked_weight, sticky_side
from runtime.config.http import HttpConfig
from runtime.http.body import BodyReader
from runtime.http.bounded_protocol import response_bytes
from runtime.http.wire import HttpError
from services.pipeline.internal_marks import SHADOW_HEADER, shadow_mark

log = logging.getLogger("spine.migration.http_front")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

SIDE_HEADER = "x-spine-side"
# What a client may name in `x-spine-route`, and the side it means (the gates call the
# from side "layered" whatever it is).
ROUTES = {"legacy": "layered", "layered": "layered", "spine": "spine"}
SIDE_NAMES = {"layered": "legacy", "spine": "spine"}
# Headers that belong to one connection (RFC 9110 §7.6.1) or that the client library sets
# again, never forwarded; `accept-encoding` is dropped so that answers come uncompressed
# and a kept answer can be read.
_NOT_FORWARDED = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                            "trailer", "transfer-encoding", "upgrade", "host", "content-length",
                            "accept-encoding"})
_NOT_ANSWERED = frozenset({"connection", "keep-alive", "transfer-encoding", "trailer", "upgrade", "server",
                           "date"})
MAX_KEPT_BYTES = 1 << 20  # an answer kept for a comparison; a longer one is not compared


class HttpFront:
    """An ASGI application that forwards each request to the legacy endpoint or the spine.

    `spine_http`: the spine's HTTP API, like `legacy.http` the root its paths begin under.
    `internal_key`: the deployment's internal secret, to mark shadow copies sent to the spine.
    A side has `connect_timeout_s` to accept a connection and `timeout_s` for each read of its
    answer (a stream may run longer while its chunks keep coming); a request waits at most
    `connect_timeout_s` for a pooled connection. `http`: the limits of the server the front is
    served by (`runtime.http.server.HttpServer`, given the same section): the front reads
    bodies under them as the API's own listener does (`runtime.http.body`)."""

    def __init__(self, legacy: LegacyEndpoint, spine_http: str, *, spine_weight: float = 0.0,
                 route_header: bool = True, mirror: MirrorSettings | None = None,
                 internal_key: bytes | None = None, http: HttpConfig | None = None, timeout_s: float = 300.0,
                 connect_timeout_s: float = 2.0, history: int = 100_000,
                 rng: random.Random | None = None) -> None:
        self.legacy = legacy
        self.urls = {"layered": legacy.http, "spine": spine_http.rstrip("/")}
        self.spine_weight = 0.0
        self.set_weight(spine_weight)
        self.route_header = route_header
        self.log = OutcomeLog(history)
        self.mirror = HttpMirror(mirror, rng, names=SIDE_NAMES) if mirror is not None else None
        self.internal_key = internal_key
        self.http = http or HttpConfig()
        self.bodies = BodyReader(self.http)  # the same bounds as the API's own listener, from one config
        self._timeout = httpx2.Timeout(timeout_s, connect=connect_timeout_s, pool=connect_timeout_s)
        pool = self.http.max_connections  # a client's connection holds at most one to a side
        self._limits = httpx2.Limits(max_connections=pool, max_keepalive_connections=pool)
        self._client: httpx2.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- the controller's side -----------------------------------------------------------
    def honour_route_header(self, honoured: bool) -> None:
        """Whether a client's `x-spine-route` may force a side (the plan's `route_header`)."""
        self.route_header = honoured

    def set_weight(self, spine_weight: float) -> None:
        self.spine_weight = checked_weight(spine_weight)

    def window(self, since: float, until: float | None = None) -> dict[str, SideWindow]:
        return self.log.window(since, until)

    def choose(self, headers: dict[str, str]) -> str:
        """The side for a request: forced by `x-spine-route` (when allowed), else by weight,
        sticky on the session or the client's key."""
        forced = ROUTES.get(headers.get(ROUTE_HEADER, "").strip().lower(), "") if self.route_header else ""
        if forced:
            return forced
        key = headers.get(SESSION_HEADER) or headers.get(self.legacy.api_key_header) or \
            headers.get("authorization") or headers.get("x-api-key", "")
        return sticky_side(key, self.spine_weight)

    # -- ASGI ------------------------------------------------------------------------------
    def refusal(self, status: int, message: str, path: str) -> bytes:
        """The whole response for a request the server's protocol refuses before the front sees
        it (a head past its limits, a connection past the cap), in the API's error shape."""
        kind = "overloaded_error" if status >= 500 else "invalid_request_error"
        body = _error_body("anthropic" if path.startswith("/v1/messages") else "openai", kind, message)
        return response_bytes(status, body, "application/json", (("retry-after", "1"),) if status >= 500 else ())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        raw = [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in scope["headers"]]
        headers = dict(raw)
        api = "anthropic" if scope["path"].startswith("/v1/messages") else "openai"
        try:
            target = _target(scope)
            body = await self.bodies.read(receive, scope["headers"])
        except HttpError as refused:  # the front's own answer: neither side was asked, neither counts it
            await _send_error(send, api, refused.status, refused.kind, refused.message, refused.headers)
            return
        side = self.choose(headers)
        proxy = asyncio.ensure_future(self._proxy(scope["method"], target, raw, body, side, api, send))
        watcher = asyncio.ensure_future(_cancel_on_disconnect(receive, proxy))
        try:
            await proxy
        except asyncio.CancelledError:
            if not proxy.cancelled():
                raise  # this task was cancelled (the server stops): not the client going away
        finally:
            watcher.cancel()

    async def _proxy(self, method: str, target: str, raw: list[tuple[str, str]], body: bytes, side: str, api: str,
                     send: Send) -> None:
        """Forward the request to `side` and stream its answer back. Only the side's own
        answer is recorded for the gates: a request the front cannot form or send is the
        front's 400, recorded for neither side."""
        try:
            request = self._client_now().build_request(method, self.urls[side] + target,
                                                       headers=self._forwarded(raw, side), content=body)
        except (httpx2.InvalidURL, httpx2.LocalProtocolError, ValueError) as error:
            await _send_error(send, api, 400, "invalid_request_error", _unformable(method, target, error))
            return
        keep = self.mirror is not None and method == "POST" and self.mirror.pick()
        started = time.perf_counter()
        in_flight = self.log.enter(side)
        status, failed, kept, content_type, asked = 0, True, bytearray(), "", True
        try:
            try:
                response = await self._client_now().send(request, stream=True)
            except (httpx2.UnsupportedProtocol, httpx2.LocalProtocolError) as error:  # refused before it left
                asked = False
                await _send_error(send, api, 400, "invalid_request_error", _unformable(method, target, error))
                return
            except httpx2.TimeoutException:
                await _send_error(send, api, 504, "timeout_error", f"the {SIDE_NAMES[side]} side did not answer "
                                  f"within {self._timeout.connect:g}s (connect) / {self._timeout.read:g}s")
                return
            except httpx2.TransportError as error:
                await _send_error(send, api, 502, "api_error",
                                  f"the {SIDE_NAMES[side]} side could not be reached: {type(error).__name__}")
                return
            try:
                status = response.status_code
                failed = status >= 500  # the side's answer; whatever the front does with it next is not the side's
                content_type = response.headers.get("content-type", "")
                await send({"type": "http.response.start", "status": status,
                            "headers": self._answer_headers(response, side)})
                async for chunk in response.aiter_raw():
                    if keep and len(kept) <= MAX_KEPT_BYTES:
                        kept += chunk
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except httpx2.TransportError as error:  # reset or timed out mid-answer: the side failed it
                failed = True
                log.warning("the %s side broke off an answer: %s", SIDE_NAMES[side], type(error).__name__)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:  # the client went away while the answer was being written: nobody's failure
                failed, status = False, 499
            finally:
                await response.aclose()
        except asyncio.CancelledError:
            failed = False  # the client went away: nobody's failure
            status = 499
            raise
        finally:
            self.log.leave(side)
            if asked:
                self.log.add(Outcome(time.time(), side, failed, (time.perf_counter() - started) * 1000.0,
                                     ok=200 <= status < 300 and not failed, model=200 <= status < 300 and not failed,
                                     in_flight=in_flight))
        if asked and keep and self.mirror is not None and len(kept) <= MAX_KEPT_BYTES:
            primary = read_answer(0 if failed and status < 500 else status, bytes(kept), content_type)
            self.mirror.offer(side, primary, _greedy(body),
                              lambda shadow_side: self._fetch_copy(shadow_side, method, target, raw, body))

    async def _fetch_copy(self, side: str, method: str, target: str, raw: list[tuple[str, str]],
                          body: bytes) -> tuple[int, bytes, str]:
        """A shadow copy of the request to `side`, read whole: (status, body, content type);
        status 0 when the side did not answer."""
        request_id = f"shadow-{secrets.token_hex(8)}"
        extra = [("x-request-id", request_id)]
        if side == "spine" and self.internal_key:
            extra.append((SHADOW_HEADER, shadow_mark(self.internal_key, request_id)))
        headers = [(k, v) for k, v in self._forwarded(raw, side) if k != "x-request-id"] + extra
        try:
            response = await self._client_now().request(method, self.urls[side] + target, headers=headers,
                                                        content=body)
        except httpx2.TransportError:
            return 0, b"", ""
        return response.status_code, response.content, response.headers.get("content-type", "")

    # -- headers -----------------------------------------------------------------------------
    def _forwarded(self, raw: list[tuple[str, str]], side: str) -> list[tuple[str, str]]:
        """The client's headers as a side gets them: nothing per connection, nothing `x-spine-*`,
        the key unchanged (to the spine as `authorization: Bearer KEY` when the legacy endpoint
        reads it from a header of its own)."""
        key_header = self.legacy.api_key_header
        translate = side == "spine" and key_header not in ("authorization", "x-api-key")
        out = []
        for name, value in raw:
            if name in _NOT_FORWARDED or name.startswith("x-spine-"):
                continue
            if translate and name == key_header:
                out.append(("authorization", f"Bearer {value}"))
                continue
            out.append((name, value))
        out.append(("accept-encoding", "identity"))
        return out

    @staticmethod
    def _answer_headers(response: httpx2.Response, side: str) -> list[tuple[bytes, bytes]]:
        out = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in response.headers.multi_items()
               if k.lower() not in _NOT_ANSWERED and not k.lower().startswith(SIDE_HEADER)]
        out.append((SIDE_HEADER.encode(), SIDE_NAMES[side].encode()))
        return out

    # -- the client ----------------------------------------------------------------------------
    def _client_now(self) -> httpx2.AsyncClient:
        """The pooled client, made on the serving loop the first time it is needed."""
        if self._client is None:
            self._loop = asyncio.get_running_loop()
            self._client = httpx2.AsyncClient(timeout=self._timeout, limits=self._limits, follow_redirects=False,
                                             trust_env=False)
        return self._client

    def close(self, timeout_s: float = 5.0) -> None:
        """Let the copies in flight finish and close the pooled connections (from another
        thread than the serving loop, before the server stops)."""
        loop, client = self._loop, self._client
        if loop is None or client is None or loop.is_closed():
            return

        async def closing() -> None:
            if self.mirror is not None:
                await self.mirror.drain(timeout_s)
            await client.aclose()

        try:
            asyncio.run_coroutine_threadsafe(closing(), loop).result(timeout_s + 1.0)
        except (RuntimeError, TimeoutError) as error:  # the loop stopped meanwhile
            log.warning("closing the HTTP front's connections: %s", error)


def _target(scope: Scope) -> str:
    """The request's target as a side gets it: a path and its query (origin form). uvicorn
    hands an absolute-form target (`GET http://host/v1/models`) over as its path; what has no
    path at all (`OPTIONS *`, `M-SEARCH *`) names no resource either side serves, so the front
    answers it itself: 400, counted for neither side."""
    raw_path: bytes = scope.get("raw_path") or scope["path"].encode("latin-1")
    target = raw_path.decode("latin-1")
    if not target.startswith("/"):
        raise HttpError(400, "invalid_request_error",
                        f"the front forwards requests for a path ('/v1/...'); {scope['method']} "
                        f"{target[:64]!r} names none")
    if scope.get("query_string"):
        target += "?" + bytes(scope["query_string"]).decode("latin-1")
    return target


def _unformable(method: str, target: str, error: Exception) -> str:
    """The message of a request the front cannot forward (it names what, not a traceback)."""
    log.debug("cannot forward %s %r: %s", method, target[:200], type(error).__name__)
    # A header's value never goes back (it may be a credential): what is wrong with it does.
    reason = "a header's value holds characters outside ASCII" if isinstance(error, UnicodeError) else str(error)
    return f"the front cannot forward {method} {target[:64]!r}: {reason}"


def _greedy(body: bytes) -> bool:
    try:
        return is_greedy(orjson.loads(body))
    except orjson.JSONDecodeError:
        return False


async def _cancel_on_disconnect(receive: Receive, proxy: asyncio.Future[None]) -> None:
    """Cancel the forwarded request the moment the client goes away (its body is read by then)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not proxy.done():
                proxy.cancel()
            return


async def _send_error(send: Send, api: str, status: int, kind: str, message: str,
                      headers: tuple[tuple[str, str], ...] = ()) -> None:
    """The front's own answer, in the shape of the API the client called (its SDK raises the
    matching exception: 502/504 are `InternalServerError`, 413 `APIStatusError`)."""
    if status == 499:
        return
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            *((name.encode("latin-1"), value.encode("latin-1")) for name, value in headers)]})
    await send({"type": "http.response.body", "body": _error_body(api, kind, message), "more_body": False})


def _error_body(api: str, kind: str, message: str) -> bytes:
    if api == "anthropic":
        return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})
    return orjson.dumps({"error": {"message": message, "type": kind, "param": None, "code": None}})


__all__ = ["SIDES", "HttpFront", "MirrorSettings"]
