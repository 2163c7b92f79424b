"""Models served by upstream servers, with the inference servicer's call shape.

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

A unary answer can also be awaited on the caller's own event loop (`generate_on_loop`): the
HTTP front does so when the model is in its process, so the request never leaves its loop.

A stream sends them as initial metadata before its first chunk (the HTTP front's headers go
out with that chunk), a unary answer as trailing metadata. A failure is the client's
status code with a message naming the upstream and what it did (`failures.py`); a stream
that breaks after its first chunk ends with UNAVAILABLE and counts against the upstream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Mapping
from typing import Any, NoReturn

import grpc

from services.common.token_estimate import UPSTREAM
from services.common.upstream_config import UpstreamSpec
from services.inference.upstream import loop
from services.inference.upstream.attempts import Cancelled, Walk
from services.inference.upstream.counters import UpstreamCollector
from services.inference.upstream.endpoint import UpstreamEndpoint
from services.inference.upstream.failures import AttemptFailure, Kind
from services.inference.upstream.protocols import Answer, Delta, conversation_text
from services.inference.upstream.token_count import TokenCounter
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

    # -- the inference servicer's rpcs, for these models -------------------------------------
    def Generate(self, request: generation_pb2.GenerateRequest, context: Any) -> generation_pb2.GenerateResponse:
        walk = Walk(self.endpoints, request.model, context)

        def attempt(endpoint: UpstreamEndpoint, timeout_s: float) -> Any:
            return walk.wait(loop.submit(endpoint.unary(request, timeout_s)), timeout_s)

        try:
            answer = walk.run(attempt)
        except (AttemptFailure, Cancelled) as failure:
            _abort(context, walk, failure)
        return _response(request, context, walk, answer)

    async def generate_on_loop(self, request: generation_pb2.GenerateRequest,
                               context: Any) -> generation_pb2.GenerateResponse:
        """`Generate`, awaited on the caller's event loop (the HTTP front's): the same walk,
        each attempt on this loop's own connection pool, no thread between the request and
        the upstream. The context's rules are the same (`_abort` raises its error)."""
        walk = Walk(self.endpoints, request.model, context)

        async def attempt(endpoint: UpstreamEndpoint, timeout_s: float) -> Answer:
            return await walk.wait_on_loop(endpoint.unary(request, timeout_s), timeout_s)

        try:
            answer = await walk.run_on_loop(attempt)
        except (AttemptFailure, Cancelled) as failure:
            _abort(context, walk, failure)
        return _response(request, context, walk, answer)

    def GenerateStream(self, request: generation_pb2.GenerateRequest,
                       context: Any) -> Iterator[generation_pb2.GenerateChunk]:
        walk = Walk(self.endpoints, request.model, context)
        running: list[Any] = [None]

        def attempt(endpoint: UpstreamEndpoint, timeout_s: float) -> tuple[Any, list[Delta]]:
            """Open a stream and wait for its first piece the client would see."""
            pieces = walk.stream_queue()
            future = loop.submit(endpoint.stream(request, timeout_s, pieces))
            running[0] = future
            walk.watch(future)
            first: list[Delta] = []
            try:
                while True:
                    delta = walk.next_piece(pieces, timeout_s)
                    if delta is None:
                        return pieces, first
                    first.append(delta)
                    if delta.text or delta.finish or delta.end:
                        return pieces, first
            except BaseException:
                future.cancel()
                raise

        try:
            pieces, first = walk.run(attempt)
        except (AttemptFailure, Cancelled) as failure:
            _abort(context, walk, failure)
        metadata = _metadata(walk)
        context.send_initial_metadata(metadata)
        context.set_trailing_metadata(metadata)
        endpoint = walk.served_by
        digest = system_digest(request.system)
        ended = Delta()
        index = 0
        texts: list[str] = []
        try:
            for delta in _pieces(walk, pieces, first, endpoint):
                ended.finish = delta.finish or ended.finish
                ended.prompt_tokens = delta.prompt_tokens or ended.prompt_tokens
                ended.completion_tokens = delta.completion_tokens or ended.completion_tokens
                ended.cached_tokens = delta.cached_tokens or ended.cached_tokens
                if delta.text or delta.events:
                    texts.append(delta.text)
                    yield generation_pb2.GenerateChunk(text=delta.text, index=index, model=request.model,
                                                       system_digest=digest, events=delta.events)
                    index += 1
            prompt, completion, counted_by = _counted(endpoint.tokens, request, ended.prompt_tokens,
                                                      ended.completion_tokens, "".join(texts))
            context.set_trailing_metadata((*metadata, (USAGE_HEADER, counted_by)))
            yield generation_pb2.GenerateChunk(index=index, finish_reason=ended.finish or "stop", model=request.model,
                                               system_digest=digest, prompt_tokens=prompt,
                                               completion_tokens=completion, cached_prompt_tokens=ended.cached_tokens)
        except AttemptFailure as failure:  # after the first chunk: nothing can be retried now
            endpoint.outlier.record(grpc.StatusCode.UNAVAILABLE, endpoint.spec.timeout_s)
            broken = AttemptFailure(Kind.BROKEN, f"the stream broke after {index} chunk(s): {failure.message}",
                                    detail=failure.detail)
            _abort(context, walk, broken)
        except Cancelled as cancelled:
            _abort(context, walk, cancelled)
        finally:  # the client went away, or it ended: the exchange and its slot end now
            if running[0] is not None:
                running[0].cancel()

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


def _pieces(walk: Walk, pieces: Any, first: list[Delta], endpoint: UpstreamEndpoint) -> Iterator[Delta]:
    """The stream's pieces: those read while it was opened, then the rest as they arrive."""
    for delta in first:
        yield delta
        if delta.end:
            return
    while True:
        remaining = walk.context.time_remaining()
        if remaining is not None and remaining <= 0:
            raise Cancelled(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed during the stream")
        timeout = endpoint.spec.timeout_s if remaining is None else min(endpoint.spec.timeout_s, remaining)
        piece = walk.next_piece(pieces, timeout)
        if piece is None:
            return
        yield piece
        if piece.end:
            return


def _response(request: generation_pb2.GenerateRequest, context: Any, walk: Walk,
              answer: Answer) -> generation_pb2.GenerateResponse:
    """The spine's answer from the upstream's, counted (`_counted`), its metadata on `context`."""
    prompt, completion, counted_by = _counted(walk.served_by.tokens, request, answer.prompt_tokens,
                                              answer.completion_tokens, answer.text)
    context.set_trailing_metadata((*_metadata(walk), (USAGE_HEADER, counted_by)))
    return generation_pb2.GenerateResponse(
        text=answer.text, model=request.model, finish_reason=answer.finish, prompt_tokens=prompt,
        completion_tokens=completion, system_digest=system_digest(request.system),
        cached_prompt_tokens=answer.cached_tokens, body=answer.body)


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


def _abort(context: Any, walk: Walk, failure: AttemptFailure | Cancelled) -> NoReturn:
    """End the call with `failure`'s code and its client-safe message; what the upstreams
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
        request_id = dict(context.invocation_metadata() or ()).get("x-request-id", "-")[:64]  # the pipeline's
        log.warning("request %s failed after %d upstream attempt(s): %s", request_id, walk.attempts,
                    "; ".join(dict.fromkeys(said)))
        message += f"; request id {request_id} (the upstream's own words are in the server's log)"
    context.set_trailing_metadata(tuple(trailing))
    context.abort(failure.code, message)
    raise AssertionError("context.abort returned")
