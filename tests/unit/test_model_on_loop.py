"""The built-in model answers a caller on an event loop on that loop: every job of a decode
step handed over with one wake-up of the loop, the same answers as a caller on a thread, and
a caller that leaves or runs out of time stops its job at once.

The tiny model in this process (no server): the model's own operations (`answer_on_loop`,
`chunks_on_loop`) awaited on a loop of the test's, with the loop's `call_soon_threadsafe`
counted."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from services.inference.service import InferenceService
from services.pipeline.interface import CallOptions
from services.pipeline.local_call import StreamHeaders, call_local_on_loop
from services.pipeline.local_context import LocalCall, LocalContext, LocalRpcError
from tests.unit.test_serving_support import GatedModel, make_service, request
from tests.waiting import eventually


@pytest.fixture
def served() -> Iterator[tuple[InferenceService, GatedModel]]:
    service, model = make_service(max_batch=4)
    try:
        yield service, model
    finally:
        service.close()


def _counting(loop: asyncio.AbstractEventLoop) -> list[Callable[..., Any]]:
    """The callbacks handed to `loop` from other threads, from now on."""
    woken: list[Callable[..., Any]] = []
    threadsafe = loop.call_soon_threadsafe

    def counted(callback: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        woken.append(callback)
        return threadsafe(callback, *args, **kwargs)

    loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
    return woken


def test_four_streams_on_one_loop_are_woken_once_per_step_not_once_per_chunk(
        served: tuple[InferenceService, GatedModel]) -> None:
    service, model = served

    async def stream(prompt: str) -> list[Any]:
        async with contextlib.aclosing(service.chunks_on_loop(request(prompt, 12), LocalCall(), StreamHeaders())) \
                as chunks:  # closed here, not by the loop's finalizer (a wake-up of its own)
            return [chunk async for chunk in chunks]

    async def four() -> tuple[list[list[Any]], int, int]:
        woken = _counting(asyncio.get_running_loop())
        steps_before = model.steps
        answers = await asyncio.gather(*(stream(f"stream {i}") for i in range(4)))
        return answers, len(woken), model.steps - steps_before

    answers, wakeups, steps = asyncio.run(four())
    chunks = sum(len(answer) for answer in answers)
    assert all(answer[-1].finish_reason for answer in answers) and chunks >= 4 * 10
    print(f"\n{chunks} chunks over {steps} steps: {wakeups} wake-ups of the loop")
    assert wakeups <= steps, "more than one wake-up of the loop per decode step"
    assert wakeups < chunks / 2


def test_four_answers_on_one_loop_wake_it_once_per_step_that_finished_one_and_never_at_their_end(
        served: tuple[InferenceService, GatedModel]) -> None:
    """A unary job's outputs come at its last step; the end of its call (every answered call
    ends after its job) must not wake the loop once more."""
    service, _ = served

    async def four() -> tuple[list[Any], int]:
        woken = _counting(asyncio.get_running_loop())
        answers = await asyncio.gather(*(call_local_on_loop(
            lambda call, i=i: service.answer_on_loop(request(f"answer {i}", 12), call), CallOptions(30))
            for i in range(4)))
        return answers, len(woken)

    answers, wakeups = asyncio.run(four())
    assert all(answer.response.completion_tokens > 0 for answer in answers)
    assert wakeups <= 4, f"{wakeups} wake-ups for 4 answers"


def test_the_answers_on_a_loop_are_the_answers_on_a_thread(served: tuple[InferenceService, GatedModel]) -> None:
    service, _ = served
    asked = request("the same answer", 10)
    on_thread = service.answer(asked, LocalCall())
    on_loop = asyncio.run(service.answer_on_loop(asked, LocalCall()))
    assert on_loop.response == on_thread.response
    assert [name for name, _ in on_loop.trailing] == ["x-spine-load"]

    async def streamed() -> tuple[str, tuple[tuple[str, str], ...]]:
        headers = StreamHeaders()
        text = "".join([chunk.text async for chunk in service.chunks_on_loop(asked, LocalCall(), headers)])
        return text, tuple(headers.trailing)

    text, trailing = asyncio.run(streamed())
    assert text == on_thread.response.text and [name for name, _ in trailing] == ["x-spine-load"]


def test_a_refusal_on_the_loop_is_the_callers_error_with_the_load_hint(
        served: tuple[InferenceService, GatedModel]) -> None:
    service, _ = served
    with pytest.raises(LocalRpcError) as refused:
        asyncio.run(service.answer_on_loop(request("", 4), LocalCall()))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "x-spine-load" in dict(refused.value.trailing_metadata())


def test_a_stream_closed_on_the_loop_frees_its_slot_before_the_next_step(
        served: tuple[InferenceService, GatedModel]) -> None:
    service, model = served

    async def two_chunks_then_leave() -> None:
        chunks = service.chunks_on_loop(request("left early", 200), LocalCall(), StreamHeaders())
        await anext(chunks)
        await anext(chunks)
        model.hold()  # the model waits between steps: only the close can free the slot now
        await chunks.aclose()

    asyncio.run(two_chunks_then_leave())
    try:
        eventually(lambda: service.scheduler.running_count == 0, 5, "the slot freed while the model is held")
    finally:
        model.open()


def test_a_caller_cancelled_while_it_waits_on_the_loop_stops_its_job(
        served: tuple[InferenceService, GatedModel]) -> None:
    service, model = served
    parent = LocalContext()
    model.hold()

    def hang_up_once_submitted() -> None:  # the HTTP client hangs up while the model is held
        eventually(lambda: service.scheduler.running_count + service.scheduler.queue_depth == 1, 5, "job submitted")
        parent.cancel()

    async def cancelled_while_waiting() -> grpc.StatusCode:
        threading.Thread(target=hang_up_once_submitted).start()
        try:
            await service.answer_on_loop(request("cancelled", 50), LocalCall(parent=parent))
        except LocalRpcError as error:
            return error.code()
        return grpc.StatusCode.OK

    try:  # answered while the model is still held: the caller is not kept waiting for the step
        assert asyncio.run(cancelled_while_waiting()) == grpc.StatusCode.CANCELLED
    finally:
        model.open()
    eventually(lambda: service.scheduler.running_count == 0, 5, "the cancelled job's slot freed")


def test_a_deadline_on_the_loop_ends_the_wait_with_deadline_exceeded(
        served: tuple[InferenceService, GatedModel]) -> None:
    service, model = served
    model.hold()
    call = LocalCall(deadline=time.monotonic() + 0.2)
    try:
        with pytest.raises(LocalRpcError) as ended:
            asyncio.run(service.answer_on_loop(request("out of time", 50), call))
        assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        model.open()
