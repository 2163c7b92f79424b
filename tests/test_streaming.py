"""Streaming end to end: cancellation frees the slot in both layouts; a model failure
mid-stream ends the stream with a status naming it, keeps the chunks sent, and is logged once."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.inference_load import parse_load
from spine.client.gateway_client import GatewayClient
from spine.runtime.config import placements_for
from spine.runtime.stack import Stack, remote_channel
from spine.v1 import generation_pb2, inference_pb2_grpc
from tests.conftest import DEV_KEY, config_for_tests

LONG = "a long greedy answer for collapsed"  # its greedy answer runs all 250 tokens (see test_layouts)


def gen(prompt: str, max_tokens: int) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(model="tiny-lm", prompt=prompt, max_tokens=max_tokens)


def inference_load(stack: Stack) -> dict[str, float]:
    """The model's own load report, read straight from the inference process (layered)."""
    assert stack.supervisor is not None
    address = stack.supervisor.children["inference"].address
    with remote_channel(address, 1 << 20) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        _, call = stub.Generate.with_call(gen("probe", 1), timeout=10)
        return parse_load(dict(call.trailing_metadata())["x-spine-load"])


def test_cancelling_a_layered_stream_frees_its_slot_in_the_inference_process(tmp_path: Path) -> None:
    config = config_for_tests()
    stack = Stack(config, placements_for("layered", config), run_dir=tmp_path / "layered")
    stack.start()
    try:
        idle = inference_load(stack)
        with GatewayClient(stack.address, DEV_KEY) as client:
            call = client.stub.GenerateStream(gen(LONG, 250), metadata=client.metadata(), timeout=60)
            first = next(iter(call))
            assert first.token_ids
            busy = inference_load(stack)
            assert busy["running"] >= 1, busy
            call.cancel()
            deadline = time.monotonic() + 10
            load = inference_load(stack)
            while load["running"] > 0 and time.monotonic() < deadline:
                time.sleep(0.05)
                load = inference_load(stack)
        assert load["running"] == 0 and load["kv_free"] == idle["kv_free"], load
    finally:
        stack.stop()


@pytest.mark.parametrize("batching", [True, False])
def test_model_failure_mid_stream_keeps_sent_chunks_and_logs_once(tmp_path: Path, batching: bool) -> None:
    config = config_for_tests(batching={"enabled": batching})
    run_dir = tmp_path / "collapsed"
    stack = Stack(config, placements_for("collapsed", config), run_dir=run_dir)
    stack.start()
    try:
        engine = stack.local_servicers["inference"].engine
        real_step = engine.step
        steps = {"n": 0}

        def failing_step() -> Any:
            steps["n"] += 1
            if steps["n"] > 4:
                raise RuntimeError("device lost")
            return real_step()

        engine.step = failing_step
        chunks: list[generation_pb2.GenerateChunk] = []
        with GatewayClient(stack.address, DEV_KEY) as client:
            call = client.stub.GenerateStream(gen(LONG, 100), metadata=client.metadata(), timeout=30)
            with pytest.raises(grpc.RpcError) as caught:
                for chunk in call:
                    chunks.append(chunk)
            request_id = dict(call.trailing_metadata() or ())["x-request-id"]
        # The gateway reports a failed model as its dependency being unavailable (retryable),
        # naming the model's own status and message.
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "INTERNAL: model failed: device lost" in (caught.value.details() or "")
        assert 1 <= len(chunks) <= 4 and [c.index for c in chunks] == list(range(len(chunks)))
        engine.step = real_step
        with GatewayClient(stack.address, DEV_KEY) as client:
            assert client.generate(gen("the process keeps serving", 3)).ok
    finally:
        stack.stop()
    lines = [json.loads(line) for line in (run_dir / "requests.jsonl").read_text().splitlines()]
    mine = [line for line in lines if line["request_id"] == request_id]
    assert len(mine) == 1, mine
    assert mine[0]["status"] == "UNAVAILABLE"
