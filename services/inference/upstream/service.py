"""Models served by upstream servers, with a model server's operations (`answer`, `chunks`).

The inference component hands a request for a router model with `upstream:` here
(`services.inference.models`), in every layout: in the spine it is called in-process, in the
layered layout the inference process is this thin client. A request walks its upstreams
(`attempts.py`: retries, fallbacks, cooldowns before the first byte); the answer is the
spine's `GenerateResponse` or stream of `GenerateChunk`s, with the upstream's own usage
(the last chunk of a stream carries it), and the metadata every such answer carries:

- `x-spine-upstream`: the model id whose upstream answered (or was tried last);
- `x-spine-attempts`: how many attempts were made (1 = the first one answered);
- `x-spine-upstream-duration-ms`: the time spent in upstream exchanges — the model's time,
  which the gateway takes out of `x-spine-overhead-duration-ms`.

A unary answer and a stream can also be awaited on the caller's own event loop
(`answer_on_loop`, `chunks_on_loop`): the HTTP API does so when the model is in its
process, so the request never leaves its loop.

A stream gives them as initial metadata before its first chunk (the HTTP API's headers go
out with that chunk), a unary answer as trailing metadata. A failure is the client's
status code with a message naming the upstream and what it did (`failures.py`); a stream
that breaks after its first chunk ends with UNAVAILABLE and counts against the upstream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any, NoReturn

import grpc

from services.common.token_estimate import UPSTREAM
from services.common.upstream_config import UpstreamSpec
from services.inference.api import Generated
from services.inference.rpcs import ModelCall
from services.inference.upstream import loop
from services.inference.upstream.attempts import Cancelled, Walk
from services.inference.upstream.counters import UpstreamCollector
from services.inference.upstream.endpoint import UpstreamEndpoint
from services.inference.upstream.failures import AttemptFailure, Kind
from services.inference.upstream.pieces import Pieces
from services.inference.upstream.protocols import Answer, Delta, conversation_text
from services.inference.upstream.token_count import TokenCounter
from services.pipeline.local_call import StreamHeaders
from services.pipeline.local_context import LocalRpcError
from services.pipeline.system_prompt import system_digest
from services.pipeline.verdicts import ATTEMPTS_HEADER, UPSTREAM_HEADER, UPSTREAM_TIME_HEADER, USAGE_HEADER
from wire.v1 import generation_pb2

log = logging.getLogger("spine.upstream")


class UpstreamModels:
    """Every upstream-served model of the router, by id."""

    def __init__(self, routes: Mapping[str, UpstreamSpec]) -> None:
        self.endpoints = {model_id: UpstreamEndpoint(model_id, spec) for model_id, spec in routes.items()}
        self.collector = UpstreamCollector(lambda: [(name, e.counters) for name, e in self.endpoints.items()])

    def __contains__(self, model: object) -> bool:
        return model in self.endpoints

    def __bool__(self) -> bool:
        return bool(self.endpoints)

    # -- the model operations (`services.inference.rpcs`), for these models -------------------
    def answer(self, request: generation_pb2.GenerateRequest, call: ModelCall) -> Generated:
        walk = Walk(self.endpoints, request.model, call)

        def attempt(endpoint: UpstreamEndpoint, timeout_s: float) -> Any:
            return walk.wait(loop.submit(endpoint.unary(request, timeout_s)), timeout_s)

        try:
            answer = walk.run(attempt)
        except (AttemptFailure, Cancelled) as failure:
            _refuse(call, walk, failure)
        return _response(request, walk, answer)

    async def answer_on_loop(self, request: generation_pb2.GenerateRequest, call: ModelCall) -> Generated:
        """`answer`, awaited on the caller's event loop (the HTTP API's): the same walk, each
        attempt on this loop's own connection pool, no thread between the request and the
        upstream; the same refusals."""
        walk = Walk(self.endpoints, request.model, call)

        async def attempt(endpoint: UpstreamEndpoint, timeout_s: float) -> Answer:
            return await walk.wait_on_loop(endpoint.unary(request, timeout_s), timeout_s)

        try:
            answer = await walk.run_on_loop(attempt)
        except (AttemptFailure, Cancelled) as failure:
            _refuse(call, walk, failure)
        return _response(request, walk, answer)

    def chunks(self, request: generation_pb2.GenerateRequest, call: ModelCall,
               headers: StreamHeaders) -> Iterator[generation_pb2.GenerateChunk]:
        walk = Walk(self.endpoints, request.model, call)
        running: list[Any] = [None]

        def attempt(endpoint: UpstreamEndpoint, timeout_s: float) -> tuple[Pieces, list[Delta]]:
            """Open a stream and wait for its first piece the client would see."""
            pieces = walk.stream_queue()
            future = loop.submit(endpoint.stream(request, timeout_s, pieces))
            running[0] = future
            walk.watch(future)
            first: list[Delta] = []
            try:
                while True:
                    delta = walk.next_piece(pieces, timeout_s)
                    if delta is None or _visible(delta, first):
                        return pieces, first
            except BaseException:
                future.cancel()
                raise

        try:
            pieces, first = walk.run(attempt)
        except (AttemptFailure, Cancelled) as failure:
            _refuse(call, walk, failure)
        chunks = _Chunks(request, call, walk, headers)
        try:
            for delta in first:
                if (chunk := chunks.take(delta)) is not None:
                    yield chunk
            while not chunks.done:
                piece = walk.next_piece(pieces, chunks.wait_s())
                if piece is None:
                    break
                if (chunk := chunks.take(piece)) is not None:
                    yield chunk
            yield chunks.last()
        except AttemptFailure as failure:  # after the first chunk: nothing can be retried now
            chunks.broke(failure)
        except Cancelled as cancelled:
            _refuse(call, walk, cancelled)
        finally:  # the client went away, or it ended: the exchange and its slot end now
            if running[0] is not None:
                running[0].cancel()

    async def chunks_on_loop(self, request: generation_pb2.GenerateRequest, call: ModelCall,
                             headers: StreamHeaders) -> AsyncIterator[generation_pb2.GenerateChunk]:
        """`chunks` on the caller's event loop (the HTTP API's): each attempt reads its
        upstream in a task of this loop, and the pieces are awaited here, so no thread stands
        between the engine's socket and the client's. The same walk, chunks and ends."""
        walk = Walk(self.endpoints, request.model, call)
        running: list[asyncio.Task[None] | None] = [None]

        async def attempt(endpoint: UpstreamEndpoint, timeout_s: float) -> tuple[Pieces, list[Delta]]:
            pieces = walk.stream_queue()
            task = asyncio.ensure_future(endpoint.stream(request, timeout_s, pieces))
            running[0] = task
            walk.watch(task)
            first: list[Delta] = []
            try:
                while True:
                    delta = await walk.next_piece_on_loop(pieces, timeout_s)
                    if delta is None or _visible(delta, first):
                        return pieces, first
            except BaseException:
                task.cancel()
                raise

        try:
            pieces, first = await walk.run_on_loop(attempt)
        except (AttemptFailure, Cancelled) as failure:
            _refuse(call, walk, failure)
        chunks = _Chunks(request, call, walk, headers)
        try:
            for delta in first:
                if (chunk := chunks.take(delta)) is not None:
                    yield chunk
            while not chunks.done:
                piece = await walk.next_piece_on_loop(pieces, chunks.wait_s())
                if piece is None:
                    break
                if (chunk := chunks.take(piece)) is not None:
                    yield chunk
            yield chunks.last()
        except AttemptFailure as failure:
            chunks.broke(failure)
        except Cancelled as cancelled:
            _refuse(call, walk, cancelled)
        finally:
            task = running[0]
            if task is not None:
                task.cancel()

    def close(self) -> None:
        """Close every upstream's connections (on the loop, briefly)."""
        if not self.endpoints:
            return

        async def close_all() -> None:
            await asyncio.gather(*(endpoint.aclose() for endpoint in self.endpoints.values()),
                                 return_exceptions=True)

        try:
            loop.submit(close_all()).result(5)
        except Exception as error:  # closing must not stop the process from stopping
            log.warning("closing upstream connections: %s", error)


def _visible(delta: Delta, first: list[Delta]) -> bool:
    """Keep `delta` among a stream's first pieces; whether the client would see something now
    (the attempt has answered: text, an end, or its finish)."""
    first.append(delta)
    return bool(delta.text or delta.finish or delta.end)


class _Chunks:
    """A stream's chunks for the client, from the upstream's pieces: each piece with text or
    events is one chunk; the last chunk carries the usage (`_counted`) and the metadata every
    answer carries. The same for a stream read on a thread or on the caller's loop."""

    def __init__(self, request: generation_pb2.GenerateRequest, call: ModelCall, walk: Walk,
                 headers: StreamHeaders) -> None:
        self.request, self.call, self.walk, self.headers = request, call, walk, headers
        self.endpoint = walk.served_by
        self.metadata = _metadata(walk)
        self.digest = system_digest(request.system)
        self.finish = ""
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0  # the upstream's usage, where it says it
        self.index = 0
        self.texts: list[str] = []
        self.done = False  # the upstream said its last piece
        headers.set_initial(self.metadata)
        headers.set_trailing(self.metadata)

    def take(self, delta: Delta) -> generation_pb2.GenerateChunk | None:
        """The client's chunk for `delta`, if it has one; its counts and finish are kept."""
        self.finish = delta.finish or self.finish
        self.prompt_tokens = delta.prompt_tokens or self.prompt_tokens
        self.completion_tokens = delta.completion_tokens or self.completion_tokens
        self.cached_tokens = delta.cached_tokens or self.cached_tokens
        self.done = self.done or delta.end
        if not (delta.text or delta.events):
            return None
        self.texts.append(delta.text)
        chunk = generation_pb2.GenerateChunk(text=delta.text, index=self.index, model=self.request.model,
                                             system_digest=self.digest, events=delta.events)
        self.index += 1
        return chunk

    def wait_s(self) -> float:
        """How long to wait for the next piece: the upstream's timeout, less when the request
        has less left (Cancelled when nothing is left)."""
        remaining = self.call.time_remaining()
        if remaining is not None and remaining <= 0:
            raise Cancelled(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed during the stream")
        timeout = self.endpoint.spec.timeout_s
        return timeout if remaining is None else min(timeout, remaining)

    def last(self) -> generation_pb2.GenerateChunk:
        """The stream's last chunk: its finish and usage; the usage's source in the trailers."""
        prompt, completion, counted_by = _counted(self.endpoint.tokens, self.request, self.prompt_tokens,
                                                  self.completion_tokens, "".join(self.texts))
        self.headers.set_trailing((*self.metadata, (USAGE_HEADER, counted_by)))
        return generation_pb2.GenerateChunk(index=self.index, finish_reason=self.finish or "stop",
                                            model=self.request.model, system_digest=self.digest, prompt_tokens=prompt,
                                            completion_tokens=completion, cached_prompt_tokens=self.cached_tokens)

    def broke(self, failure: AttemptFailure) -> NoReturn:
        """The stream broke after its first chunk: nothing can be retried now; it counts
        against the upstream."""
        self.endpoint.outlier.record(grpc.StatusCode.UNAVAILABLE, self.endpoint.spec.timeout_s)
        broken = AttemptFailure(Kind.BROKEN, f"the stream broke after {self.index} chunk(s): {failure.message}",
                                detail=failure.detail)
        _refuse(self.call, self.walk, broken)


def _response(request: generation_pb2.GenerateRequest, walk: Walk, answer: Answer) -> Generated:
    """The spine's answer from the upstream's, counted (`_counted`), with its metadata."""
    prompt, completion, counted_by = _counted(walk.served_by.tokens, request, answer.prompt_tokens,
                                              answer.completion_tokens, answer.text)
    return Generated(generation_pb2.GenerateResponse(
        text=answer.text, model=request.model, finish_reason=answer.finish, prompt_tokens=prompt,
        completion_tokens=completion, system_digest=system_digest(request.system),
        cached_prompt_tokens=answer.cached_tokens, body=answer.body),
        (*_metadata(walk), (USAGE_HEADER, counted_by)))


def _counted(tokens: TokenCounter, request: generation_pb2.GenerateRequest, prompt: int, completion: int,
             text: str) -> tuple[int, int, str]:
    """(prompt tokens, completion tokens, whose count): the upstream's where it gave them,
    else counted here (its model's tokenizer where configured, else the estimate), so an
    answer without `usage` is charged all the same, whole or streamed."""
    counted_by = UPSTREAM
    if not prompt:
        prompt, counted_by = tokens.count(conversation_text(request)), tokens.name
    if not completion and text:
        completion, counted_by = tokens.count(text), tokens.name
    return prompt, completion, counted_by


def _metadata(walk: Walk) -> tuple[tuple[str, str], ...]:
    return ((UPSTREAM_HEADER, walk.served_by.model_id), (ATTEMPTS_HEADER, str(walk.attempts)),
            (UPSTREAM_TIME_HEADER, f"{walk.upstream_s * 1000:.3f}"))


def _refuse(call: ModelCall, walk: Walk, failure: AttemptFailure | Cancelled) -> NoReturn:
    """End the request with `failure`'s code and its client-safe message; what the upstreams
    said that only the operator may read goes to the log, under the request id the client
    is given, so one finds the other."""
    trailing = list(_metadata(walk))
    if isinstance(failure, AttemptFailure) and failure.kind in (Kind.OVERLOADED, Kind.BUSY):
        trailing.append(("retry-after", f"{failure.retry_after_s if failure.retry_after_s is not None else 1.0:.3f}"))
    message = str(failure)
    if walk.attempts > 1:
        message += f" (after {walk.attempts} attempts)"
    said = [f"{f.message}: {f.detail}" for f in [*walk.failures, failure]
            if isinstance(f, AttemptFailure) and f.detail]
    if said:
        request_id = dict(call.invocation_metadata() or ()).get("x-request-id", "-")[:64]  # the pipeline's
        log.warning("request %s failed after %d upstream attempt(s): %s", request_id, walk.attempts,
                    "; ".join(dict.fromkeys(said)))
        message += f"; request id {request_id} (the upstream's own words are in the server's log)"
    raise LocalRpcError(failure.code, message, tuple(trailing))
