"""The ASGI application: an HTTP request in, one call of the Gateway's shape, the API's answer out.

The call goes to `target` — the gateway (the spine, the layered gateway) or the migration's
front — exactly as a gRPC call would: a `GenerateRequest`, and a `LocalContext` carrying the
request's metadata, cancelled the moment the client goes away (so a stream's KV slot and
its tenant's concurrency count are given back at once).

A unary request to a gateway whose steps can all run on this server's event loop
(`serves_on_loop`: the spine, the layered gateway, a spine mid-migration) is served there
from accept to answer: the gateway's pipeline runs there (a step in this process is
microseconds of CPU; one in another process is awaited on its grpc.aio stub through the loop
bridge, `services.pipeline.loop_bridge`), an upstream or a model process is awaited on this
loop's own connections, and the answer's headers come back as values.

A stream to such a gateway is served there too: the engine's chunks are awaited and written
to the client's socket from this loop.

The spine's built-in model is awaited there as well: its outputs are handed to this loop
once per decode step (`services.inference.loop_outbox`).

Anything else — the migration's front, a gateway whose steps or hooks may block (a
component bound to a service the team runs, in its own protocol; an injected latency) — is
blocking code, run on a handler thread of this
server's own pool, sized like the gRPC server's
(`runtime.server.request_threads`): a request waiting for the model holds a thread, never the
event loop. Such a stream's chunks cross back to the loop through a bounded window.

Everything an API does not decide itself — limits on the body, JSON, the credential's
headers, the status of a verdict — is decided here once for both APIs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import grpc
import orjson

from runtime.config.http import HttpConfig
from runtime.http import anthropic_api, openai_api, responses_api
from runtime.http.body import BodyReader, has_body
from runtime.http.bounded_protocol import response_bytes
from runtime.http.sending import Scope, Send, abort_of, send_error, send_json
from runtime.http.stream_relay import END, GONE, pump_stream, relay
from runtime.http.stream_window import StreamWindow
from runtime.http.verdicts import gateway_failed, verdict_of, with_status
from runtime.http.wire import (
    LAYOUT,
    REQUEST_ID,
    HttpError,
    bad_request,
    request_metadata,
)
from services.common.thread_names import name_os_thread
from services.gateway.request_ids import REQUEST_ID_HEADER, safe_request_id
from services.pipeline.local_context import LocalContext
from services.pipeline.pipeline import code_details
from services.pipeline.verdicts import OVERHEAD_HEADER, USAGE_HEADER

if TYPE_CHECKING:
    from runtime.http.admin_http import AdminHttp

log = logging.getLogger("spine.http")

Receive = Callable[[], Awaitable[dict[str, Any]]]
Trailing = tuple[tuple[str, str], ...]

ROUTES = {
    "/v1/chat/completions": ("POST", openai_api),
    "/v1/completions": ("POST", openai_api),
    "/v1/embeddings": ("POST", openai_api),
    "/v1/responses": ("POST", responses_api),
    "/v1/messages": ("POST", anthropic_api),
    "/v1/models": ("GET", openai_api),
    "/health": ("GET", openai_api),
}


class HttpApi:
    """Serves both APIs in front of `target` (an object with the Gateway servicer's
    `Generate(request, context)` and `GenerateStream(request, context)`)."""

    def __init__(self, target: Any, config: HttpConfig, *, threads: int, default_max_tokens: int,
                 layout: Callable[[], str], models: Callable[[], Sequence[tuple[str, str]]],
                 serving: Callable[[], bool] = lambda: True, admin: AdminHttp | None = None) -> None:
        self.target = target
        self.config = config
        self.default_max_tokens = default_max_tokens
        self.layout = layout
        self.models = models  # (name, model id) for every id and alias
        self.serving = serving
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="http", initializer=name_os_thread)
        self.bodies = BodyReader(config)  # every body this server reads, under the http section's limits
        self.admin = admin  # `/admin/` when the server has an admin token

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def refusal(self, status: int, message: str, path: str) -> bytes:
        """The whole response for a request the connection's protocol refuses before the app
        sees it (a head past its limits, a connection past the cap), in the API's error shape."""
        api: Any = anthropic_api if path.startswith("/v1/messages") else openai_api
        request_id = safe_request_id(None)
        kind = "overloaded_error" if status >= 500 else "invalid_request_error"
        headers = ((REQUEST_ID, request_id), (LAYOUT, self.layout()), *((("retry-after", "1"),) if status >= 500 else ()))
        return response_bytes(status, api.error_body(HttpError(status, kind, message), request_id),
                              "application/json", headers)

    # -- ASGI ---------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        arrived = time.perf_counter()  # x-spine-overhead-duration-ms counts from here
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        request_id = safe_request_id(_header(headers, b"x-request-id"))
        path, method = scope["path"], scope["method"]
        route = ROUTES.get(path)
        api: Any = (responses_api if path == "/v1/responses" else anthropic_api if path.startswith("/v1/messages")
                    else openai_api)
        base = ((REQUEST_ID, request_id), (LAYOUT, self.layout()))
        if path == "/admin" or path.startswith("/admin/"):
            await self._admin_call(scope, receive, send, headers, (*base, _overhead(arrived)), request_id)
            return
        try:
            if route is None:
                raise HttpError(404, "not_found_error", f"no route {path}; this server has "
                                f"{', '.join(sorted(ROUTES))}")
            if method != route[0]:
                raise HttpError(405, "invalid_request_error", f"{path} takes {route[0]}, not {method}",
                                (("allow", route[0]),))
            if path == "/v1/models":
                await send_json(send, 200, self._model_list(), (*base, _overhead(arrived)))
                return
            if path == "/health":
                serving = self.serving()
                await send_json(send, 200 if serving else 503, orjson.dumps({"serving": serving}),
                                 (*base, _overhead(arrived)))
                return
            body = await self._read_json(scope, receive, headers)
            parsed = _parse(path, body, self.default_max_tokens)
            metadata = (*request_metadata(headers), (REQUEST_ID_HEADER, request_id))
        except HttpError as error:  # answered here, no model: all of its time is overhead
            await send_error(send, api, error, (*base, _overhead(arrived)), request_id)
            return
        context = LocalContext(metadata, arrived=arrived)
        watcher = asyncio.ensure_future(_watch_disconnect(receive, context))
        try:
            if parsed.stream:
                await self._stream(send, api, parsed, context, base, abort_of(scope))
            else:
                await self._unary(send, api, parsed, context, base)
        finally:
            watcher.cancel()

    async def _admin_call(self, scope: Scope, receive: Receive, send: Send, headers: list[tuple[bytes, bytes]],
                          base: Trailing, request_id: str) -> None:
        """An `/admin/` request, answered by the admin API on a handler thread (it reads stores)."""
        method = scope["method"]
        try:
            if self.admin is None:
                raise HttpError(404, "not_found_error", "the admin API is off: start the server with an admin "
                                "token (spine up --admin-token-file FILE, or $SPINE_ADMIN_TOKEN)")
            body: Any = {}
            if method in ("POST", "PATCH") and has_body(headers):  # Content-Length or chunked
                body = await self._read_json(scope, receive, headers, empty={})
        except HttpError as error:
            await send_error(send, openai_api, error, base, request_id)
            return
        named = {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in headers}
        loop = asyncio.get_running_loop()
        status, answer = await loop.run_in_executor(self.pool, self.admin.handle, method, scope["path"],
                                                    scope.get("query_string", b""), named, lambda: body)
        await send_json(send, status, answer, base)

    # -- reading ------------------------------------------------------------------------
    async def _read_json(self, scope: Scope, receive: Receive, headers: list[tuple[bytes, bytes]],
                         empty: Any = None) -> Any:
        """The body as JSON (`empty` for an empty body, when given: an admin call's chunked
        body may turn out to hold nothing)."""
        content_type = (_header(headers, b"content-type") or "").split(";")[0].strip().lower()
        if content_type != "application/json":
            raise HttpError(415, "invalid_request_error",
                            f"content-type must be application/json, got {content_type or 'none'!r}")
        body = await self.bodies.read(receive, headers)
        if not body and empty is not None:
            return empty
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError as error:
            raise bad_request(f"the request body is not valid JSON (UTF-8): {error}") from None

    def _model_list(self) -> bytes:
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "spine", "root": model}
                for name, model in self.models()]
        return orjson.dumps({"object": "list", "data": data})

    # -- calling the pipeline -----------------------------------------------------------
    async def _unary(self, send: Send, api: Any, parsed: Any, context: LocalContext, base: Trailing) -> None:
        loop = asyncio.get_running_loop()
        serves_on_loop = getattr(self.target, "serves_on_loop", None)
        if serves_on_loop is not None and serves_on_loop(parsed.request):  # the spine, over an upstream
            outcome, headers = await self._on_loop(parsed.request, context)
        else:
            outcome = await loop.run_in_executor(self.pool, _call_unary, self.target, parsed.request, context)
            headers = context.trailing_metadata()
        trailing = (*base, *headers)
        request_id = dict(trailing)[REQUEST_ID]
        if isinstance(outcome, HttpError):
            await send_error(send, api, with_status(outcome, api, trailing), trailing, request_id)
            return
        await send_json(send, 200, api.answer(parsed, outcome, request_id, dict(trailing).get(USAGE_HEADER, "")),
                         trailing)

    async def _on_loop(self, request: Any, context: LocalContext) -> tuple[Any, Trailing]:
        """The gateway's answer (or its verdict as an HttpError) and the headers it goes out
        with, served on this loop (`Gateway.generate_on_loop`); a model that holds a thread
        while it works is called on this server's handler pool."""
        loop = asyncio.get_running_loop()

        def offload(function: Callable[..., Any], *args: Any) -> Awaitable[Any]:
            return loop.run_in_executor(self.pool, function, *args)

        try:
            answer: tuple[Any, Trailing] = await self.target.generate_on_loop(request, context, offload)
            return answer
        except grpc.RpcError as error:
            _, _, trailing = code_details(error)
            return verdict_of(error), trailing or context.trailing_metadata()
        except Exception:
            return gateway_failed(context.invocation_metadata()), context.trailing_metadata()

    async def _stream(self, send: Send, api: Any, parsed: Any, context: LocalContext, base: Trailing,
                      abort: Callable[[], None]) -> None:
        serves_on_loop = getattr(self.target, "serves_on_loop", None)
        if serves_on_loop is not None and serves_on_loop(parsed.request):  # the spine, over an upstream
            await self._stream_on_loop(send, api, parsed, context, base, abort)
            return
        loop = asyncio.get_running_loop()
        window = StreamWindow(loop)

        def gone() -> None:
            window.end(GONE)
            window.close()

        context.add_callback(gone)
        loop.run_in_executor(self.pool, pump_stream, self.target, parsed.request, context, window)
        try:
            await relay(send, api, parsed, context, base, window.get, window.empty, abort, self.config.stream_stall_s)
        finally:
            window.close()  # the handler thread stops pulling the stream, whatever ended it

    async def _stream_on_loop(self, send: Send, api: Any, parsed: Any, context: LocalContext, base: Trailing,
                              abort: Callable[[], None]) -> None:
        """The gateway's stream served on this loop (`Gateway.generate_stream_on_loop`): each
        chunk is written as the engine's bytes arrive, with no thread between them; closing
        the gateway's stream (the client left, stopped reading, or the answer ended) stops the
        engine's exchange at once."""
        loop = asyncio.get_running_loop()

        def offload(function: Callable[..., Any], *args: Any) -> Awaitable[Any]:
            return loop.run_in_executor(self.pool, function, *args)

        left: list[bool] = []
        context.add_callback(lambda: left.append(True))
        chunks = self.target.generate_stream_on_loop(parsed.request, context, offload)

        async def next_item() -> Any:
            if left:
                return GONE
            try:
                return await anext(chunks)
            except StopAsyncIteration:
                return END
            except grpc.RpcError as error:
                return GONE if left else verdict_of(error)
            except Exception:
                return GONE if left else gateway_failed(context.invocation_metadata())

        try:
            await relay(send, api, parsed, context, base, next_item, lambda: True, abort, self.config.stream_stall_s)
        finally:
            await chunks.aclose()


def _parse(path: str, body: Any, default_max_tokens: int) -> Any:
    try:
        if path == "/v1/chat/completions":
            return openai_api.parse_chat(body, default_max_tokens)
        if path == "/v1/completions":
            return openai_api.parse_completion(body, default_max_tokens)
        if path == "/v1/embeddings":
            return openai_api.parse_embeddings(body)
        if path == "/v1/responses":
            return responses_api.parse(body, default_max_tokens)
        return anthropic_api.parse(body)
    except (ValueError, TypeError) as error:  # what the message types refuse (text that is not UTF-8, say)
        raise bad_request(f"the request cannot be read: {error}") from None


# -- on a handler thread ------------------------------------------------------------------
def _call_unary(target: Any, request: Any, context: LocalContext) -> Any:
    """The answer, or the verdict as an HttpError (status not yet chosen: see `with_status`)."""
    try:
        return target.Generate(request, context)
    except grpc.RpcError as error:
        return verdict_of(error)
    except Exception:
        return gateway_failed(context.invocation_metadata())


async def _watch_disconnect(receive: Receive, context: LocalContext) -> None:
    """Cancel the call the moment the client goes away (the body has been read by then)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            context.cancel()
            return



def _overhead(arrived: float) -> tuple[str, str]:
    """`x-spine-overhead-duration-ms` of an answer the front gives itself (no model was asked)."""
    return OVERHEAD_HEADER, f"{(time.perf_counter() - arrived) * 1000.0:.3f}"


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None
