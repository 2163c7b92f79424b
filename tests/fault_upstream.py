"""A misbehaving OpenAI-compatible upstream for tests: a real HTTP server on 127.0.0.1 (uvicorn).

Each request's `model` says how it misbehaves, so one server plays every fault:

| model | answer |
|---|---|
| `hang` | nothing, ever (until the client goes away) |
| `reset` | a stream's first piece, then the connection drops mid-stream; a whole answer cut short |
| `bad-json` | 200 with a body that is not JSON |
| `bad-sse` | 200 `text/event-stream` whose event is not JSON |
| `overloaded` | 429 with `Retry-After: 30` |
| `overloaded-once` | every other request: 429 with `Retry-After: 0.2`; the others forwarded |
| `context` | 400 naming the maximum context length |
| `flaky` | 503 for 30% of requests (a seeded draw); the rest forwarded to the real model server |
| `brief` | "ok", whatever max_tokens: usage 5 prompt and 1 completion tokens (plain or streamed) |
| `wrong-key` | 401 quoting the Authorization header it got, as OpenAI's own 401 does |
| `leaky-500` | 500 whose body names a database URL with its password, and the key it got |
| `echo-400` | 400 about the request, quoting the key it got in its message |
| `blank-lines` | 200 `text/event-stream` of nothing but blank lines, as fast as it can, until the client leaves |
| `firehose` | 200 `text/event-stream` of 1 KiB content events, as fast as the client reads, until it leaves |
| `no-usage` | 60 words and no `usage` (plain or streamed) |
| `echo` | an engine that honours every field, in the protocol asked (`/chat/completions`, `/messages`, `/embeddings`): `tests.echo_engine` |
| `bad-image` | 400 about the request's image, as vLLM refuses an image for a text-only model |
| anything else | forwarded to the real model server (`forward_to`), model `default` |

`GET /v1/models` lists the models of `context_lengths` as vLLM does, each with its `max_model_len`
(none: a listing without context lengths).

`received` keeps every body sent to `echo` and `bad-image`, as sent. `hits` counts requests by model, so a test can tell how many attempts reached it; `left` the
endless and hung answers whose client (the spine) went away.
"""

from __future__ import annotations

import asyncio
import random
import socket
import threading
from collections import Counter
from typing import Any

import httpx2
import orjson
import uvicorn

from tests import echo_engine


class FaultUpstream:
    def __init__(self, forward_to: str, key: str | None, *, port: int = 0, fail_share: float = 0.3,
                 tls: tuple[str, str] | None = None, context_lengths: dict[str, int | None] | None = None) -> None:
        self.forward_to = forward_to.rstrip("/")  # the real server's base_url (…/v1)
        self.context_lengths = context_lengths or {}
        self.key = key
        self.hits: Counter[str] = Counter()
        self.received: list[dict[str, Any]] = []  # the bodies `echo` and `bad-image` were sent
        self.left: Counter[str] = Counter()  # endless answers whose client went away, by model
        self.fail_share = fail_share
        self._draw = random.Random(7)
        self._lock = threading.Lock()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", port))
        self.port = self._sock.getsockname()[1]
        self.scheme = "https" if tls else "http"
        certificate = {"ssl_certfile": tls[0], "ssl_keyfile": tls[1]} if tls else {}
        self._server = uvicorn.Server(uvicorn.Config(self._app, interface="asgi3", lifespan="off", log_level="error",
                                                     access_log=False, **certificate))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)
        self._client: httpx2.AsyncClient | None = None

    @property
    def base_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}/v1"

    def start(self) -> FaultUpstream:
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the fault upstream did not start")
            threading.Event().wait(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._sock.close()

    # -- ASGI -------------------------------------------------------------------------------
    async def _app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] == "GET" and scope["path"].endswith("/models"):
            with self._lock:
                self.hits["GET /models"] += 1
            listing = [{"id": name, "object": "model", "owned_by": "vllm",
                        **({"max_model_len": length} if length else {})}
                       for name, length in self.context_lengths.items()]
            await _send(send, 200, orjson.dumps({"object": "list", "data": listing}), b"application/json")
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = orjson.loads(body or b"{}")
        model = str(request.get("model", ""))
        stream = bool(request.get("stream"))
        with self._lock:
            self.hits[model] += 1
            failing = model == "flaky" and self._draw.random() < self.fail_share
        if model in ("echo", "bad-image"):
            with self._lock:
                self.received.append(request)
        if model == "echo" and scope["path"].endswith("/embeddings"):
            await _send(send, 200, echo_engine.embeddings(request), b"application/json")
            return
        if model == "echo":
            anthropic = scope["path"].endswith("/messages")
            if stream:
                answer = echo_engine.anthropic_stream(request) if anthropic else echo_engine.openai_stream(request)
                await _send(send, 200, answer, b"text/event-stream")
            else:
                answer = echo_engine.anthropic_answer(request) if anthropic else echo_engine.openai_answer(request)
                await _send(send, 200, answer, b"application/json")
            return
        if model == "bad-image":
            message = "Image input is not supported by this model (it is a text-only model)"
            await _send(send, 400, orjson.dumps({"error": {"message": message, "type": "BadRequestError",
                                                           "param": None, "code": 400}}), b"application/json")
            return
        if model == "hang":
            while (await receive())["type"] != "http.disconnect":
                pass
            with self._lock:
                self.left[model] += 1
            return
        if model == "reset":
            kind = b"text/event-stream" if stream else b"application/json"
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", kind), (b"content-length", b"100000")]})
            piece = {"choices": [{"index": 0, "delta": {"content": "partial"}, "finish_reason": None}]}
            await send({"type": "http.response.body", "body": b"data: " + orjson.dumps(piece) + b"\n\n",
                        "more_body": True})
            await asyncio.sleep(0.05)
            raise ConnectionResetError("the fault upstream drops the connection mid-answer")
        if model == "bad-json":
            await _send(send, 200, b'{"choices": [{"message": ', b"application/json")
            return
        if model == "bad-sse":
            await _send(send, 200, b"data: {this is not json}\n\n", b"text/event-stream")
            return
        if model == "overloaded":
            await _send(send, 429, b'{"error": {"message": "slow down", "type": "rate_limit_error"}}',
                        b"application/json", [(b"retry-after", b"30")])
            return
        if model == "overloaded-once" and self.hits[model] % 2 == 1:
            await _send(send, 429, b'{"error": {"message": "a moment", "type": "rate_limit_error"}}',
                        b"application/json", [(b"retry-after", b"0.2")])
            return
        if model == "context":
            await _send(send, 400, b'{"error": {"message": "This model\'s maximum context length is 16 tokens", '
                                   b'"type": "invalid_request_error", "code": "context_length_exceeded"}}',
                        b"application/json")
            return
        if model == "brief":
            await _brief(send, stream)
            return
        got = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        if model == "wrong-key":
            message = f"Incorrect API key provided: {got}. You can find your API key at https://example.invalid."
            await _send(send, 401, orjson.dumps({"error": {"message": message, "type": "invalid_request_error",
                                                           "code": "invalid_api_key"}}), b"application/json")
            return
        if model == "leaky-500":
            await _send(send, 500, f"psycopg.OperationalError: postgres://app:{LEAKED_PASSWORD}@10.1.2.3:5432/app "
                                   f"refused the connection (request had {got})".encode(), b"text/plain")
            return
        if model == "echo-400":
            message = f"temperature must be at most 2 (the request authorized as {got})"
            await _send(send, 400, orjson.dumps({"error": {"message": message, "type": "invalid_request_error"}}),
                        b"application/json")
            return
        if model in ("blank-lines", "firehose"):
            await _endless(receive, send, model)
            with self._lock:
                self.left[model] += 1
            return
        if model == "no-usage":
            await _without_usage(send, stream)
            return
        if failing:
            await _send(send, 503, b'{"error": {"message": "injected 503", "type": "server_error"}}',
                        b"application/json")
            return
        await self._forward({**request, "model": "default"}, send)

    async def _forward(self, request: dict[str, Any], send: Any) -> None:
        if self._client is None:
            self._client = httpx2.AsyncClient(trust_env=False, timeout=30)
        headers = {"authorization": f"Bearer {self.key}"} if self.key else {}
        async with self._client.stream("POST", f"{self.forward_to}/chat/completions", json=request,
                                       headers=headers) as answer:
            kind = answer.headers.get("content-type", "application/json").encode()
            await send({"type": "http.response.start", "status": answer.status_code,
                        "headers": [(b"content-type", kind)]})
            async for chunk in answer.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _send(send: Any, status: int, body: bytes, kind: bytes,
                extra: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", kind), *(extra or [])]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


LEAKED_PASSWORD = "hunter2-db-password"  # noqa: S105 - what a leaky upstream's 5xx names
NO_USAGE_TEXT = " ".join(f"word{i}" for i in range(60))  # what `no-usage` answers: 60 words


async def _endless(receive: Any, send: Any, model: str) -> None:
    """Blank lines, or content events, until the client goes away. uvicorn's `send` waits while
    the client does not read (a `firehose` is as fast as its reader), and returns at once once
    it has gone, so a watcher on `receive` says when to stop."""
    left = asyncio.Event()

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        left.set()

    watcher = asyncio.ensure_future(watch())
    event = {"choices": [{"index": 0, "delta": {"content": "x" * 1024}, "finish_reason": None}]}
    piece = b"\n" * 65536 if model == "blank-lines" else (b"data: " + orjson.dumps(event) + b"\n\n") * 16
    try:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        while not left.is_set():
            await send({"type": "http.response.body", "body": piece, "more_body": True})
            await asyncio.sleep(0)
    finally:
        watcher.cancel()


async def _without_usage(send: Any, stream: bool) -> None:
    common = {"id": "chatcmpl-no-usage", "created": 0, "model": "no-usage"}
    if not stream:
        await _send(send, 200, orjson.dumps({**common, "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": NO_USAGE_TEXT}, "finish_reason": "stop"}]}),
            b"application/json")
        return
    words = NO_USAGE_TEXT.split(" ")
    events = [{"choices": [{"index": 0, "delta": {"content": word if i == 0 else f" {word}"}, "finish_reason": None}]}
              for i, word in enumerate(words)]
    events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    body = b"".join(b"data: " + orjson.dumps({**common, "object": "chat.completion.chunk", **event}) + b"\n\n"
                    for event in events) + b"data: [DONE]\n\n"
    await _send(send, 200, body, b"text/event-stream")


BRIEF_USAGE = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}


async def _brief(send: Any, stream: bool) -> None:
    common = {"id": "chatcmpl-brief", "created": 0, "model": "brief"}
    if not stream:
        await _send(send, 200, orjson.dumps({**common, "object": "chat.completion", "usage": BRIEF_USAGE, "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}),
            b"application/json")
        return
    events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
              {"choices": [], "usage": BRIEF_USAGE}]
    body = b"".join(b"data: " + orjson.dumps({**common, "object": "chat.completion.chunk", **event}) + b"\n\n"
                    for event in events) + b"data: [DONE]\n\n"
    await _send(send, 200, body, b"text/event-stream")
