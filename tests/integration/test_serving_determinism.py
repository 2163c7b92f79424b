"""Deterministic mode: bit-identical answers across runs, batch sizes, unary/stream and layouts.

The layouts differ only in how the Inference servicer is reached — called in-process
(collapsed) or behind a real gRPC server (layered) — so both are exercised here with the
same request, alone and inside a busy batch.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from runtime.server import start_server
from services.inference.service import InferenceService
from services.pipeline.local_context import LocalContext
from services.registry import DEFAULT
from tests.unit.test_serving_support import Call, GatedModel, generate, make_service, request
from tests.waiting import eventually
from wire.v1 import generation_pb2, inference_pb2_grpc

pytestmark = pytest.mark.usefixtures("torch_one_thread")


GREEDY = request("The same question", 24)
SAMPLED = request("A sampled one", 24, temperature=0.9)  # no seed: deterministic mode fixes it


def _streamed(service: InferenceService, req: generation_pb2.GenerateRequest) -> list[int]:
    chunks = service.GenerateStream(req, LocalContext())
    return [t for chunk in chunks for t in chunk.token_ids]


def _inside_busy_batch(service: InferenceService, model: GatedModel, req: generation_pb2.GenerateRequest) -> list[int]:
    """`req` decoded while six other requests of every kind share its batch."""
    model.hold()
    others = [Call(service, request(f"neighbour {i}", 10 + 7 * i, temperature=0.5 * (i % 3), seed=i))
              for i in range(6)]
    eventually(lambda: service.engine.active_count + service.scheduler.queue_depth == 6)
    model.release(1)  # one step: every neighbour is in the batch by the next
    eventually(lambda: service.engine.active_count == 6)
    target = Call(service, req)
    # Queued behind the held step, or already admitted if the scheduler was between steps.
    eventually(lambda: service.scheduler.queue_depth == 1 or service.engine.active_count == 7)
    model.release(2)  # it joins mid-way, while the neighbours decode
    model.open()
    for call in others:
        call.wait()
    return target.wait().tokens


def test_deterministic_answers_match_alone_in_a_busy_batch_streamed_and_across_runs() -> None:
    answers: dict[str, list[list[int]]] = {"greedy": [], "sampled": []}
    for _run in range(2):
        service, model = make_service(deterministic=True, kv_cache_max_entries=8, max_batch=8)
        try:
            assert torch.are_deterministic_algorithms_enabled()
            for name, req in (("greedy", GREEDY), ("sampled", SAMPLED)):
                answers[name].append(list(generate(service, req)[0].token_ids))
                answers[name].append(_streamed(service, req))
                answers[name].append(_inside_busy_batch(service, model, req))
        finally:
            service.close()
        assert not torch.are_deterministic_algorithms_enabled()  # the mode ends with the service
    for name, runs in answers.items():
        assert len(runs[0]) == 24, name
        assert all(run == runs[0] for run in runs), name


def test_the_layered_hop_answers_exactly_what_the_in_process_call_does() -> None:
    service, _ = make_service(deterministic=True)
    server = start_server([(DEFAULT["inference"], service)], "127.0.0.1:0")
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            for req in (GREEDY, SAMPLED):
                local = list(generate(service, req)[0].token_ids)
                remote, call = stub.Generate.with_call(req, timeout=60)
                assert list(remote.token_ids) == local
                assert "x-spine-load" in dict(call.trailing_metadata())
                assert [t for c in stub.GenerateStream(req, timeout=60) for t in c.token_ids] == local
    finally:
        server.stop(grace=0.5)
        service.close()
