"""A model's blocking stream read from an event loop (the router chose a built-in model for a
request served on the loop): each chunk is fetched on a handler thread, never on the loop, in
order, and a cancel from the loop reaches the model."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

from services.gateway.model_calls import _Offloaded
from wire.v1 import generation_pb2


class BlockingStream:
    """A `ChunkStream` whose every chunk notes the thread that produced it."""

    def __init__(self, texts: list[str]) -> None:
        self._chunks: Iterator[str] = iter(texts)
        self.threads: list[int] = []
        self.cancelled = False

    def __iter__(self) -> BlockingStream:
        return self

    def __next__(self) -> generation_pb2.GenerateChunk:
        self.threads.append(threading.get_ident())
        return generation_pb2.GenerateChunk(text=next(self._chunks))

    def cancel(self) -> bool:
        self.cancelled = True
        return True

    def initial_metadata(self) -> list[tuple[str, str]]:
        return [("x-spine-load", "q=0")]

    def trailing_metadata(self) -> list[tuple[str, str]]:
        return [("x-spine-usage", "model")]


def test_chunks_come_in_order_from_a_handler_thread_and_a_cancel_reaches_the_model() -> None:
    model = BlockingStream(["a", "b", "c"])

    async def read() -> tuple[list[str], int]:
        loop = asyncio.get_running_loop()

        def offload(function: Any, *args: Any) -> Any:
            return loop.run_in_executor(None, function, *args)

        stream = _Offloaded(model, offload)  # type: ignore[arg-type]
        texts = [chunk.text async for chunk in stream]
        assert list(stream.initial_metadata()) == [("x-spine-load", "q=0")]
        assert list(stream.trailing_metadata()) == [("x-spine-usage", "model")]
        assert await stream.cancel()
        return texts, threading.get_ident()

    texts, loop_thread = asyncio.run(read())
    assert texts == ["a", "b", "c"]
    assert model.threads and loop_thread not in model.threads  # the end was asked off the loop too
    assert model.cancelled
