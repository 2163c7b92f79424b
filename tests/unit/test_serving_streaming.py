"""Streaming flow control in the Inference servicer: slow readers judged by time and memory,
prompt cancellation.

A reader is stopped when its output has waited unread for `stream_idle_timeout_s`, or when
what it leaves unread passes `stream_buffer_max_bytes` — RESOURCE_EXHAUSTED, because it ran
out of a server resource, not because anyone cancelled it — and its slot comes back; its
batch mates finish untouched. A reader that lags by many chunks but keeps reading is never
stopped: a chunk count is something a full-speed reader on a busy host reaches.
"""

from __future__ import annotations

import threading
from typing import Any

import grpc
import pytest

from services.inference.jobs import OUTPUT_BYTES
from services.pipeline.local_context import LocalContext, LocalRpcError
from tests.unit.test_serving_support import generate, make_service, request
from tests.waiting import ManualClock, eventually

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def test_a_reader_that_stops_reading_is_stopped_after_the_idle_timeout_and_spares_its_batch_mate() -> None:
    clock = ManualClock()
    service, model = make_service(clock=clock, kv_cache_max_entries=2, max_batch=2, stream_idle_timeout_s=5)
    try:
        mate_alone = list(generate(service, request("batch mate", 40))[0].token_ids)
        model.hold()
        before = model.steps
        slow = service.GenerateStream(request("slow reader", 120, inference_timeout_ms=60_000), LocalContext())
        received: list[Any] = []
        reader = threading.Thread(target=lambda: received.append(next(slow)), daemon=True)
        reader.start()
        model.release(3)  # a few tokens: one is read, the others wait unread
        reader.join(30)
        eventually(lambda: model.steps == before + 3)
        clock.advance(4.0)  # within the idle timeout: nothing happens
        model.release(2)
        eventually(lambda: model.steps == before + 5)
        assert service.engine.active_count == 1
        clock.advance(2.0)  # 6 s without a read while output waits
        model.open()
        eventually(lambda: service.engine.free_slots == 2, what="the slow stream's slot came back")
        mate, _ = generate(service, request("batch mate", 40))
        assert list(mate.token_ids) == mate_alone
        with pytest.raises(LocalRpcError) as stopped:
            received.extend(slow)
        assert stopped.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "stream consumer too slow" in stopped.value.details()
        assert "inference.stream_idle_timeout_s = 5" in stopped.value.details()
        # what was generated before the stop is delivered, and is a prefix of the full answer
        assert 1 < len(received) < 120
        full = list(generate(service, request("slow reader", 120))[0].token_ids)
        assert [t for chunk in received for t in chunk.token_ids] == full[: len(received)]
    finally:
        model.open()
        service.close()


def test_a_reader_that_leaves_more_than_the_byte_bound_unread_is_stopped() -> None:
    service, _ = make_service(stream_buffer_max_bytes=1024)
    try:
        slow = service.GenerateStream(request("slow reader", 120), LocalContext())
        received = [next(slow)]  # in the batch; then it stops reading
        eventually(lambda: service.engine.active_count == 0, what="the stream was stopped")
        with pytest.raises(LocalRpcError) as stopped:
            received.extend(slow)
        assert stopped.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "more than 1024 bytes" in stopped.value.details()
        assert "inference.stream_buffer_max_bytes" in stopped.value.details()
        assert len(received) <= 1 + 1024 // OUTPUT_BYTES + 1
    finally:
        service.close()


def test_a_reader_that_lags_by_a_hundred_chunks_but_keeps_reading_gets_the_whole_answer() -> None:
    service, _ = make_service()
    try:
        full = list(generate(service, request("a lagging reader", 200))[0].token_ids)
        stream = service.GenerateStream(request("a lagging reader", 200), LocalContext())
        chunks = [next(stream)]
        # The reader lags the whole answer: every chunk is generated before it reads the second.
        eventually(lambda: service.engine.active_count == 0, what="the whole answer generated")
        chunks.extend(stream)
        assert len(full) > 100, "the test needs an answer longer than the old 64-chunk rule"
        assert [t for chunk in chunks for t in chunk.token_ids] == full
    finally:
        service.close()


def test_a_cancelled_stream_frees_its_slot_within_one_decode_step() -> None:
    service, model = make_service(kv_cache_max_entries=2, max_batch=2)
    try:
        model.hold()
        before = model.steps  # the warm-up's
        context = LocalContext()
        stream = service.GenerateStream(request("to be cancelled", 100), context)
        first: list[object] = []
        reader = threading.Thread(target=lambda: first.append(next(stream)), daemon=True)
        reader.start()
        model.release(1)  # the prefill step: the first chunk arrives
        reader.join(30)
        assert first, "no first chunk"
        eventually(lambda: model.steps == before + 1)
        context.cancel()  # the scheduler is now waiting inside step 2
        model.release(1)  # let exactly one more step run
        eventually(lambda: service.engine.active_count == 0 and service.engine.free_slots == 2,
                   what="the slot came back after one step")
        assert model.steps == before + 2
        with pytest.raises(LocalRpcError) as cancelled:
            list(stream)
        assert cancelled.value.code() == grpc.StatusCode.CANCELLED
    finally:
        model.open()
        service.close()


def test_a_waiting_request_that_is_cancelled_leaves_the_queue_at_once() -> None:
    service, model = make_service(kv_cache_max_entries=1, max_batch=1)
    try:
        model.hold()
        before = model.steps
        busy = service.GenerateStream(request("busy", 5), LocalContext())
        reader = threading.Thread(target=lambda: list(busy), daemon=True)
        reader.start()
        eventually(lambda: service.engine.active_count == 1)
        context = LocalContext()
        waiting = service.GenerateStream(request("waiting", 5), context)
        outcome: list[grpc.StatusCode] = []

        def start_waiting() -> None:
            try:
                next(waiting)
            except LocalRpcError as error:
                outcome.append(error.code())

        starter = threading.Thread(target=start_waiting, daemon=True)
        starter.start()
        eventually(lambda: service.scheduler.queue_depth == 1)
        context.cancel()
        eventually(lambda: service.scheduler.queue_depth == 0, what="the queue emptied without a step")
        assert model.steps == before
        starter.join(30)
        assert outcome == [grpc.StatusCode.CANCELLED]
    finally:
        model.open()
        service.close()


def test_a_stream_its_reader_closes_frees_its_slot_without_a_cancel() -> None:
    service, _ = make_service(kv_cache_max_entries=2, max_batch=2)
    try:
        stream = service.GenerateStream(request("closed early", 200), LocalContext())
        next(stream)
        assert service.engine.active_count == 1
        stream.close()  # what the gateway's generator does when its client goes away
        eventually(lambda: service.engine.free_slots == 2, timeout=2.0, what="the closed stream's slot came back")
        job = service.scheduler.recent_admissions[-1]
        assert job.tokens < 200 and job.cancelled
    finally:
        service.close()
