"""Streaming flow control in the Inference servicer: bounded per-stream buffers, prompt cancellation.

A consumer that stops reading is stopped by the scheduler once its buffer is full —
RESOURCE_EXHAUSTED, because it ran out of a server resource (its bounded buffer), not
because anyone cancelled it — and its slot comes back; its batch mates finish untouched.
"""

from __future__ import annotations

import threading

import grpc
import pytest

from spine.runtime.bindings import LocalContext, LocalRpcError
from tests.test_serving_support import eventually, generate, make_service, request

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def test_a_slow_stream_consumer_is_stopped_frees_its_slot_and_does_not_hold_back_its_batch_mate() -> None:
    service, _ = make_service(kv_cache_max_entries=2, max_batch=2, stream_buffer_chunks=4)
    try:
        mate_alone = list(generate(service, request("batch mate", 40))[0].token_ids)
        slow = service.GenerateStream(request("slow reader", 120), LocalContext())
        received = [next(slow)]  # in the batch; then it stops reading
        mate, _ = generate(service, request("batch mate", 40))
        assert list(mate.token_ids) == mate_alone
        eventually(lambda: service.engine.free_slots == 2, what="the slow stream's slot came back")
        with pytest.raises(LocalRpcError) as stopped:
            received.extend(slow)
        assert stopped.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "stream consumer too slow" in stopped.value.details()
        assert "stream_buffer_chunks = 4" in stopped.value.details()
        # what was buffered before the stop is delivered, and is a prefix of the full answer
        assert 1 < len(received) < 120
        full = list(generate(service, request("slow reader", 120))[0].token_ids)
        assert [t for chunk in received for t in chunk.token_ids] == full[: len(received)]
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
