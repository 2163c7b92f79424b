"""What a stream adds up to as its chunks pass the gateway, and a blocking stream read from a loop.

The gateway's stream is the same on a handler thread (`Gateway.GenerateStream`) and on the
HTTP front's event loop (`Gateway.generate_stream_on_loop`): each chunk is policed and counted
the same way, so the record, the charge and the cached answer do not depend on which ran it.
`StreamTally` is that count. `OffloadedStream` lets the loop read a model that holds a thread
while it works (the built-in one, where the router chose it for a request that was expected to
stay on the loop) a chunk at a time through the server's handler pool.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.inference.api import ChunkStream
from wire.v1 import generation_pb2


@dataclass
class StreamTally:
    """A stream's chunks so far: its tokens and text, its finish, its system digest and the
    usage the model counted itself (an upstream's, on its last chunk)."""

    started: float  # when the model was called (perf_counter)
    check: Any  # the output policy's check for this stream (None: no policy)
    tokens: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    finish: str = ""
    digest: str = ""
    usage: tuple[int, int, int] = (0, 0, 0)  # prompt, completion, cached
    first: bool = True  # no chunk has been released yet

    def take(self, chunk: generation_pb2.GenerateChunk) -> bool:
        """Count `chunk`; whether it is the stream's first."""
        first, self.first = self.first, False
        self.tokens.extend(chunk.token_ids)
        self.texts.append(chunk.text)
        self.finish = chunk.finish_reason or self.finish
        self.digest = chunk.system_digest or self.digest
        if chunk.completion_tokens or chunk.prompt_tokens:
            self.usage = (chunk.prompt_tokens, chunk.completion_tokens, chunk.cached_prompt_tokens)
        return first


_END = object()


def _next(stream: ChunkStream) -> Any:
    return next(stream, _END)


class OffloadedStream:
    """A blocking `ChunkStream` read from an event loop, each chunk fetched by `offload`
    (a handler thread); `cancel` stops the model from the loop (a `ChunkStream`'s cancel is
    safe from any thread)."""

    def __init__(self, stream: ChunkStream, offload: Callable[..., Awaitable[Any]]) -> None:
        self._stream = stream
        self._offload = offload

    def __aiter__(self) -> AsyncIterator[generation_pb2.GenerateChunk]:
        return self

    async def __anext__(self) -> generation_pb2.GenerateChunk:
        chunk = await self._offload(_next, self._stream)
        if chunk is _END:
            raise StopAsyncIteration
        return chunk  # type: ignore[no-any-return]

    async def cancel(self) -> bool:
        return self._stream.cancel()

    def initial_metadata(self) -> Sequence[tuple[str, str]]:
        return self._stream.initial_metadata()

    def trailing_metadata(self) -> Sequence[tuple[str, str]]:
        return self._stream.trailing_metadata()
