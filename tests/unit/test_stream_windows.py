"""The two bounded hand-overs of a stream: the upstream loop's pieces to a handler thread
(`Pieces`), and a handler thread's chunks to the HTTP event loop (`StreamWindow`). Past its
bound the producer waits; a stream's end always goes in; closing lets a waiting producer go."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from runtime.http.stream_window import StreamWindow
from services.inference.upstream.pieces import Pieces
from tests.waiting import eventually


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    running = asyncio.new_event_loop()
    thread = threading.Thread(target=running.run_forever, daemon=True)
    thread.start()
    try:
        yield running
    finally:
        running.call_soon_threadsafe(running.stop)
        thread.join(5)
        running.close()


def test_the_upstream_loop_waits_for_room_and_the_end_never_waits(loop: asyncio.AbstractEventLoop) -> None:
    pieces = Pieces(limit=2)

    async def produce() -> None:
        for i in range(5):
            await pieces.put(i)

    producing = asyncio.run_coroutine_threadsafe(produce(), loop)
    eventually(lambda: len(pieces._items) == 2, what="two pieces in")
    assert not producing.done()  # full: the upstream is not read meanwhile
    pieces.end("end")  # the end goes in past the bound
    taken = [pieces.get(5) for _ in range(6)]  # each take makes room for the next piece
    producing.result(5)
    assert taken == [0, 1, "end", 2, 3, 4]


def test_a_handler_thread_waits_for_the_event_loop_until_the_window_closes(loop: asyncio.AbstractEventLoop) -> None:
    window = asyncio.run_coroutine_threadsafe(_window(loop), loop).result(5)
    results: list[bool] = []
    producer = threading.Thread(target=lambda: results.extend(window.put(i) for i in range(4)))
    producer.start()
    eventually(lambda: results == [True, True] and not window.empty(), what="two chunks in")
    assert producer.is_alive()  # the third waits for room
    window.close()  # the client left: the waiting producer is let go, and told
    producer.join(5)
    assert results == [True, True, False, False]
    assert asyncio.run_coroutine_threadsafe(window.get(), loop).result(5) == 0  # what was in stays readable


async def _window(loop: asyncio.AbstractEventLoop) -> StreamWindow:
    return StreamWindow(loop, limit=2)
