"""The spine's admission waits to batch more requests only while the model has a backlog.

Waiting is free only then: a request admitted a few ms later still finds a full batch of
work queued before it. Without a backlog, for the latency class, or for a model that is
not served here, admission decides at once (`GatewayBatching.model_backlogged`).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from services.pipeline.state import RequestState
from spine.client.gateway_client import CallResult, GatewayClient
from tests.conftest import DEV_KEY, config_for_tests, start_stack
from tests.waiting import eventually
from wire.v1 import generation_pb2

SLOTS = 2
STEP_MS = 20


def state(model: str = "tiny-lm", priority: int = 0) -> RequestState:
    request = generation_pb2.GenerateRequest(model=model, prompt="hello", max_tokens=4, priority=priority)
    return RequestState(request=request, request_id="r", layout="collapsed", started=time.perf_counter(),
                        deadline=time.monotonic() + 30, shadow=False, metadata=(), model=model)


def test_admission_batches_with_a_wait_only_while_the_model_has_a_backlog(tmp_path: Path) -> None:
    config = config_for_tests(
        inference={"backend": {"class": "tests.paced_backend:paced", "options": {"step_ms": STEP_MS}},
                   "warmup_tokens": 2, "max_batch": SLOTS},
        batching={"max_wait_us": 50_000})
    stack = start_stack("collapsed", tmp_path, config)
    try:
        inference = stack.components.local_inference().first
        assert inference.engine.max_slots == SLOTS
        assert not stack.batching.model_backlogged([state()])  # idle: a wait would cost the model time
        with GatewayClient(stack.address, DEV_KEY) as client:
            results: list[CallResult] = []
            lock = threading.Lock()

            def call(tag: str, max_tokens: int) -> None:
                result = client.generate(generation_pb2.GenerateRequest(
                    model="tiny-lm", prompt=f"backlog {tag}", max_tokens=max_tokens))
                with lock:
                    results.append(result)

            long = [threading.Thread(target=call, args=(f"long {i}", 30)) for i in range(2 * SLOTS + 2)]
            for thread in long:
                thread.start()
            # Both counts: right after the first submissions the loop may not have taken any
            # job yet, and four waiting would then not mean every long one was admitted.
            eventually(lambda: (inference.scheduler.running_count, inference.scheduler.queue_depth)
                       == (SLOTS, len(long) - SLOTS), what="every long request in the model")
            assert stack.batching.model_backlogged([state()])
            assert not stack.batching.model_backlogged([state(priority=1)])  # the latency class goes ahead of the queue
            assert not stack.batching.model_backlogged([state(model="no-such-model")])
            assert not stack.batching.model_backlogged([state(), state(model="no-such-model")])

            admission = stack.admission
            before = (admission.stats.batches, admission.stats.items, admission.stats.waited)
            short = [threading.Thread(target=call, args=(f"short {i}", 2)) for i in range(6)]
            for thread in short:
                thread.start()
            for thread in [*long, *short]:
                thread.join(60)
        assert [r.code.name for r in results if not r.ok] == []
        assert len(results) == len(long) + len(short)
        decided, items, waited = (now - then for now, then in zip(
            (admission.stats.batches, admission.stats.items, admission.stats.waited), before, strict=True))
        assert items == len(short)
        assert waited >= 1 and decided < items  # the backlog let the leader wait: fewer, larger batches
        assert not stack.batching.model_backlogged([state()])  # drained: nothing waits any more
    finally:
        stack.stop()
