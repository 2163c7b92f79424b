"""The `sim` backend: a device's step time spent off the CPU, deterministic tokens, and
`spine up --model sim` serving it in both layouts as it serves a real model."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import grpc
import pytest

from monolith.device import DeviceContext
from runtime.processes.launch import launch, spine_up_argv
from services.common import ConfigError
from services.inference.load_hints import LOAD_HEADER, parse_load
from services.inference.model.backend import load_backend, make_engine
from services.inference.model.engine import GenerationRequest
from services.inference.model.interface import Segment
from services.inference.model.sim_backend import (
    LLAMA3_8B_H100,
    SimModel,
    load_sim_backend,
    next_token,
    profile_from,
)
from services.inference.service import InferenceConfig, InferenceService
from services.pipeline.local_context import LocalContext, LocalRpcError
from tests.conftest import DEV_KEY
from wire.v1 import gateway_pb2_grpc, generation_pb2

FREE = {"decode_base_ms": 0, "decode_ms_per_seq": 0, "prefill_ms_per_token": 0, "max_context": 256}
ANSWERS: dict[str, list[int]] = {}


def test_a_step_costs_the_profiles_device_time_and_waits_for_it_off_the_cpu() -> None:
    backend = load_sim_backend({"decode_base_ms": 20, "decode_ms_per_seq": 5, "prefill_ms_per_token": 1,
                                "max_context": 256})
    model = backend.model
    assert model.profile.step_ms(sequences=2, prefill_tokens=10) == 20 + 2 * 5 + 10 * 1
    cache = model.new_cache(2, 256, "cpu")
    started_wall, started_cpu = time.perf_counter(), time.thread_time()
    model.step([Segment(0, 0, (256, 1, 2, 3, 4)), Segment(1, 0, (256, 9, 9, 9, 9))], cache)  # 20+10+10 ms
    for position in range(5, 12):
        model.step([Segment(0, position, (65,)), Segment(1, position, (66,))], cache)  # 30 ms each
    wall, cpu = time.perf_counter() - started_wall, time.thread_time() - started_cpu
    assert model.steps == 8 and model.device_s == pytest.approx(0.040 + 7 * 0.030)
    assert wall >= model.device_s  # every step lasted its device time ...
    assert cpu < wall / 4  # ... in which the thread held no CPU (a sleep, as a wait on a stream)


def test_tokens_depend_on_the_sequence_alone_not_on_batch_mates_or_a_shared_prefix() -> None:
    backend = load_sim_backend(FREE)
    engine = make_engine(backend, "cpu", 4)
    prompt = backend.encode("the same question")
    alone = engine.generate([GenerationRequest(prompt, 12)])[0].token_ids
    batched = engine.generate([GenerationRequest(backend.encode(f"other {i}"), 5 + i) for i in range(3)]
                              + [GenerationRequest(prompt, 12)])[-1].token_ids
    system = backend.encode("You are a helpful assistant. " * 4)
    with_prefix = engine.generate([GenerationRequest(prompt, 12, prefix_ids=system) for _ in range(3)])
    plain = engine.generate([GenerationRequest(system + prompt, 12)])[0].token_ids
    assert alone == batched and len(alone) == 12
    assert all(result.token_ids == plain for result in with_prefix)  # shared blocks read the same hashes
    assert engine.kv is not None and engine.kv.prefixes.hits >= 1  # ... and were shared
    assert all(32 <= token < 127 for token in alone) and alone != plain
    assert alone[0] == next_token(_hash_of([backend.tokenizer.bos_id, *prompt]))


def _hash_of(tokens: list[int]) -> int:
    model = SimModel(profile_from(FREE), 258)
    cache = model.new_cache(1, 256, "cpu")
    model.step([Segment(0, 0, tuple(tokens))], cache)
    return cache.get(0, len(tokens) - 1)


def test_the_kv_budget_in_tokens_bounds_the_pool_and_options_are_checked() -> None:
    config = InferenceConfig.parse({"model_id": "sim", "max_batch": 64, "backend": {
        "class": "sim", "options": {**FREE, "kv_budget_tokens": 1024}}})
    service = InferenceService(config, DeviceContext())
    try:
        assert service.engine.max_slots == 4  # 1024 tokens of KV at 256 tokens a sequence
    finally:
        service.close()
    assert profile_from({}) == LLAMA3_8B_H100 and "h100" in LLAMA3_8B_H100.name
    with pytest.raises(ConfigError, match=r"inference.backend.options: unknown option\(s\) decode_ms"):
        load_backend({"class": "sim", "options": {"decode_ms": 3}})
    with pytest.raises(ConfigError, match="inference.backend.options.decode_base_ms: expected a number >= 0"):
        load_backend({"class": "sim", "options": {"decode_base_ms": -1}})
    with pytest.raises(ConfigError, match="options.profile: unknown profile 'a100'"):
        load_backend({"class": "sim", "options": {"profile": "a100"}})


def test_compute_budgets_and_load_hints_work_on_the_simulated_device() -> None:
    config = InferenceConfig.parse({"model_id": "sim", "max_batch": 4, "backend": {
        "class": "sim", "options": {**FREE, "decode_base_ms": 10}}})
    service = InferenceService(config, DeviceContext())
    try:
        assert service.ms_per_token >= 10  # measured on the simulated steps at the warm-up
        context = LocalContext()
        answer = service.Generate(generation_pb2.GenerateRequest(model="sim", prompt="hi", max_tokens=3), context)
        assert answer.completion_tokens == 3
        hint = parse_load(dict(context.trailing_metadata())[LOAD_HEADER])
        assert hint["slots"] == 4 and hint["ms_per_token"] >= 10
        failed: list[LocalRpcError] = []

        def slow() -> None:
            try:
                service.Generate(generation_pb2.GenerateRequest(model="sim", prompt="long", max_tokens=200,
                                                                inference_timeout_ms=100), LocalContext())
            except LocalRpcError as error:
                failed.append(error)

        thread = threading.Thread(target=slow)
        thread.start()
        thread.join(timeout=30)
        assert failed and failed[0].code() == grpc.StatusCode.DEADLINE_EXCEEDED  # 200 steps of 10 ms > 100 ms
    finally:
        service.close()


@pytest.mark.parametrize("layout", ["collapsed", "layered"])
def test_spine_up_model_sim_serves_a_generate_call_in_every_layout(tmp_path: Path, layout: str) -> None:
    launched = launch("spine up", spine_up_argv(None, layout, listen="127.0.0.1:0", http_listen="127.0.0.1:0",
                                                run_dir=tmp_path / "run", extra=("--model", "sim")),
                      log_path=tmp_path / "spine.log")
    process = launched.process
    try:
        ready = launched.wait_ready(120)
        assert ready["layout"] == layout
        with grpc.insecure_channel(ready["address"]) as channel:
            answer, call = gateway_pb2_grpc.GatewayStub(channel).Generate.with_call(
                generation_pb2.GenerateRequest(model="default", prompt="Hello, device!", max_tokens=8),
                metadata=(("authorization", f"Bearer {DEV_KEY}"),), timeout=60)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    assert answer.model == "sim" and len(answer.token_ids) == 8 and answer.finish_reason == "length"
    hint = parse_load(dict(call.trailing_metadata())[LOAD_HEADER])
    assert hint["ms_per_token"] >= LLAMA3_8B_H100.decode_base_ms  # the profile's step time, measured
    ANSWERS[layout] = list(answer.token_ids)
    if len(ANSWERS) == 2:
        assert ANSWERS["collapsed"] == ANSWERS["layered"]
