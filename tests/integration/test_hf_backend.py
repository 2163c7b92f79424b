"""The transformers backend (`inference.backend.class: hf`) on tiny models made here, offline.

Specifications: the engine's answers equal the model's own full forward (the KV cache in
the slot pool is exact); per-sequence steps are bit-identical in any batch, joining at any
step; batched steps agree with them to float rounding; slots and their KV memory come back;
a directory that cannot be served is one line naming the field and the limit.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import grpc
import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from monolith.device import DeviceContext  # noqa: E402
from runtime.server import start_server  # noqa: E402
from services.common import ConfigError  # noqa: E402
from services.inference.model.backend import load_backend, make_engine  # noqa: E402
from services.inference.model.engine import GenerationEngine, GenerationRequest  # noqa: E402
from services.inference.model.hf_backend import HFBackend, load_hf_backend  # noqa: E402
from services.inference.model.interface import KV_CACHE_OWNER, Segment  # noqa: E402
from services.inference.service import InferenceConfig, InferenceService  # noqa: E402
from services.pipeline.local_context import LocalContext, LocalRpcError  # noqa: E402
from services.pipeline.system_prompt import system_digest  # noqa: E402
from services.registry import DEFAULT  # noqa: E402
from spine.tools.model.make_tiny import TinySpec, make_tiny  # noqa: E402
from wire.v1 import generation_pb2, inference_pb2_grpc  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")

CPU = torch.device("cpu")
PROMPTS = ["Hello, world!", "The model decodes many sequences together", "a", "What is the time? It is half past nine"]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-models")
    return {arch: make_tiny(root / f"tiny-{arch}", TinySpec(arch=arch)) for arch in ("llama", "gpt2")}


@pytest.fixture(scope="module")
def backends(model_dirs: dict[str, Path]) -> dict[str, HFBackend]:
    return {arch: load_hf_backend({"path": str(path)}) for arch, path in model_dirs.items()}


def _requests(backend: HFBackend, **fields: Any) -> list[GenerationRequest]:
    return [GenerationRequest(prompt_ids=backend.encode(p), max_tokens=6 + 3 * i, **fields)
            for i, p in enumerate(PROMPTS)]


def _reference(backend: HFBackend, req: GenerationRequest) -> list[int]:
    """Greedy tokens from the transformers module itself, every step a full forward without a cache."""
    module = backend.model.module
    ids = [backend.tokenizer.bos_id, *req.prompt_ids]
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(req.max_tokens):
            token = int(torch.argmax(module(torch.tensor([ids])).logits[0, -1]))
            if token == backend.tokenizer.eos_id:
                break
            out.append(token)
            ids.append(token)
    return out


# -- the KV cache in the pool is exact -----------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_batched_answers_equal_the_models_own_full_forward(backends: dict[str, HFBackend], arch: str) -> None:
    backend = backends[arch]
    engine = make_engine(backend, CPU, 4)
    try:
        requests = _requests(backend)
        answers = engine.generate(requests)
        assert [a.token_ids for a in answers] == [_reference(backend, r) for r in requests]
    finally:
        engine.close()


# -- batch invariance ------------------------------------------------------------------------
def _step_rows(backend: HFBackend, groups: list[list[Segment]], slots: int = 4) -> dict[int, torch.Tensor]:
    """Logits per slot after stepping `groups` one after another on a fresh pool."""
    model = backend.model
    cache = model.new_cache(slots, 64, CPU)
    rows: dict[int, torch.Tensor] = {}
    for group in groups:
        for seg, row in zip(group, model.step(group, cache), strict=True):
            rows[seg.slot] = row
    return rows


SEGMENTS = [Segment(0, 0, (0, 17, 42, 99, 7)), Segment(1, 0, (0, 5)), Segment(2, 0, (0, 300, 301, 302))]
FOLLOW = [Segment(0, 5, (11,)), Segment(1, 2, (12, 13, 14)), Segment(2, 4, (15,))]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_per_sequence_steps_are_bit_identical_in_any_batch(backends: dict[str, HFBackend], arch: str) -> None:
    backend = backends[arch]
    backend.model.batch_invariant = True
    try:
        together = _step_rows(backend, [SEGMENTS, FOLLOW])
        alone = {}
        for first, second in zip(SEGMENTS, FOLLOW, strict=True):
            alone.update(_step_rows(backend, [[first], [second]]))
        assert all(torch.equal(together[slot], alone[slot]) for slot in alone)
    finally:
        backend.model.batch_invariant = None


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_batched_step_agrees_with_per_sequence_steps_to_float_rounding(
        backends: dict[str, HFBackend], arch: str) -> None:
    backend = backends[arch]
    backend.model.batch_invariant = False
    try:
        batched = _step_rows(backend, [SEGMENTS, FOLLOW])  # prefill and decode mixed, padded, in one forward
        backend.model.batch_invariant = True
        alone = _step_rows(backend, [SEGMENTS, FOLLOW])
    finally:
        backend.model.batch_invariant = None
    for slot, row in alone.items():
        torch.testing.assert_close(batched[slot], row, atol=1e-4, rtol=1e-4)


def test_deterministic_mode_answers_the_same_alone_and_joining_a_running_batch(backends: dict[str, HFBackend]) -> None:
    backend = backends["llama"]
    engine = make_engine(backend, CPU, 4)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # what `inference.deterministic: true` switches on
    try:
        requests = _requests(backend, temperature=0.9, seed=5)
        alone = [engine.generate([req])[0].token_ids for req in requests]
        assert joining_midway(engine, requests, steps=3) == alone
    finally:
        torch.use_deterministic_algorithms(before)
        engine.close()


def joining_midway(engine: GenerationEngine, requests: list[GenerationRequest], steps: int) -> list[list[int]]:
    """Answers when the first request decodes `steps` steps alone and the others then join it."""
    first = engine.submit(requests[0])
    for _ in range(steps):
        engine.step()
    late = [engine.submit(req) for req in requests[1:]]
    while engine.active_count:
        engine.step()
    return [h.token_ids for h in (first, *late)]


def test_a_reused_slot_ignores_what_the_previous_sequence_left(backends: dict[str, HFBackend]) -> None:
    backend = backends["llama"]
    short = GenerationRequest(prompt_ids=backend.encode("a"), max_tokens=4)
    engine = make_engine(backend, CPU, 1)
    try:
        fresh = engine.generate([short])[0].token_ids
        engine.generate([GenerationRequest(prompt_ids=backend.encode(" ".join(PROMPTS)), max_tokens=20)])
        assert engine.generate([short])[0].token_ids == fresh
    finally:
        engine.close()


# -- the KV pool -----------------------------------------------------------------------------
def test_the_kv_pool_is_charged_to_the_device_budget_and_every_slot_comes_back(
        backends: dict[str, HFBackend]) -> None:
    backend = backends["llama"]
    # 2 layers × 2 (keys, values) × 2 kv heads × 16 head dim × 4 bytes per token
    assert backend.model.kv_bytes_per_slot(512) == 2 * 2 * 2 * 16 * 512 * 4
    device = DeviceContext(device=CPU, budget_bytes=64 << 20)
    engine = GenerationEngine(backend.model, backend.tokenizer, device, 3, 128)
    assert device.usage()[KV_CACHE_OWNER] == 3 * backend.model.kv_bytes_per_slot(128)
    requests = _requests(backend)
    handles = [engine.submit(req) for req in requests[:3]]
    assert engine.free_slots == 0
    engine.step()
    engine.cancel(handles[1])
    assert engine.free_slots == 1
    while engine.active_count:
        engine.step()
    assert engine.free_slots == 3
    engine.close()
    assert device.usage()[KV_CACHE_OWNER] == 0


def test_auto_kv_slots_are_sized_from_the_models_layers_heads_and_context(model_dirs: dict[str, Path]) -> None:
    per_slot = 2 * 2 * 2 * 16 * 64 * 4  # layers × (k, v) × kv heads × head dim × context × float32
    config = InferenceConfig.parse({"model_id": "tiny-llama", "max_batch": 64, "kv_memory_fraction": 1.0,
                                        "backend": {"class": "hf", "options": {"path": str(model_dirs["llama"]),
                                                                               "max_context": 64}}})
    budget = 4 << 20
    service = InferenceService(config, DeviceContext(device=CPU, budget_bytes=budget))
    try:
        plan = service.kv_plan
        assert plan.per_slot_bytes == per_slot and plan.source == "auto"
        assert plan.slots == min(64, (budget - plan.weight_bytes) // per_slot)
    finally:
        service.close()


# -- the service --------------------------------------------------------------------------------
def _service(path: Path, **config: Any) -> InferenceService:
    section = {"model_id": "tiny-llama", "max_batch": 4, "backend": {"class": "hf", "options": {"path": str(path)}},
               **config}
    return InferenceService(InferenceConfig.parse(section), DeviceContext(device=CPU))


def _generate(service: InferenceService, prompt: str, max_tokens: int, **fields: Any) -> Any:
    req = generation_pb2.GenerateRequest(model="tiny-llama", prompt=prompt, max_tokens=max_tokens, **fields)
    return service.Generate(req, LocalContext())


def test_the_service_answers_for_the_served_model_and_refuses_a_context_past_the_models(
        model_dirs: dict[str, Path]) -> None:
    service = _service(model_dirs["llama"], backend={"class": "hf", "options": {"path": str(model_dirs["llama"]),
                                                                                 "max_context": 64}})
    try:
        answer = _generate(service, "Hello, world!", 8)
        assert answer.model == "tiny-llama" and len(answer.token_ids) == 8 and answer.finish_reason == "length"
        service.health_probe()
        with pytest.raises(LocalRpcError) as refused:
            _generate(service, "Hello " * 40, 30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "exceeds the model's context of 64" in refused.value.details()
    finally:
        service.close()


def test_deterministic_service_answers_the_same_in_process_and_over_the_layered_hop(
        model_dirs: dict[str, Path]) -> None:
    service = _service(model_dirs["gpt2"], deterministic=True)
    server = start_server([(DEFAULT["inference"], service)], "127.0.0.1:0")
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            for fields in ({}, {"temperature": 0.8}):
                req = generation_pb2.GenerateRequest(model="tiny-llama", prompt="Same question", max_tokens=12,
                                                     **fields)
                local = list(service.Generate(req, LocalContext()).token_ids)
                assert len(local) == 12
                assert list(stub.Generate(req, timeout=60).token_ids) == local
    finally:
        server.stop(grace=None)
        service.close()


def test_a_system_prompt_goes_through_the_chat_template(model_dirs: dict[str, Path]) -> None:
    service = _service(model_dirs["llama"], deterministic=True)
    try:
        answer = _generate(service, "How are you?", 6, system="Be brief.")
        ids = service.backend.encode_chat("How are you?", "Be brief.")  # type: ignore[attr-defined]
        assert answer.prompt_tokens == len(ids) and answer.system_digest == system_digest("Be brief.")
        expected = service.engine.generate([GenerationRequest(ids, 6)])[0].token_ids
        assert list(answer.token_ids) == expected
        plain = _generate(service, "How are you?", 6)
        assert plain.prompt_tokens == len(service.backend.encode("How are you?")) and plain.system_digest == ""
    finally:
        service.close()


# -- the tokenizer -------------------------------------------------------------------------------
def test_the_models_own_tokenizer_round_trips_and_applies_its_chat_template(backends: dict[str, HFBackend]) -> None:
    backend = backends["llama"]
    text = "Hello, world! How are you today?"
    assert backend.decode(backend.encode(text)) == text
    plain = backend.encode_chat("How are you?")
    with_system = backend.encode_chat("How are you?", system="Be brief.")
    vocab = backend.tokenizer.hf.get_vocab()
    assert with_system[0] == vocab["<|system|>"] and vocab["<|system|>"] not in plain
    assert with_system[-1] == plain[-1] == vocab["<|assistant|>"]
    assert backend.tokenizer.bos_id not in with_system  # the engine puts BOS first itself


# -- errors: one line naming the field and the limit ------------------------------------------------
def _copy(src: Path, dst: Path, **config_changes: Any) -> Path:
    shutil.copytree(src, dst)
    if config_changes:
        config = json.loads((dst / "config.json").read_text())
        config.update(config_changes)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def _refusal(options: dict[str, Any], device: Any = None) -> str:
    with pytest.raises(ConfigError) as refused:
        load_backend({"model_id": "m", "class": "hf", "options": options}, device=device)
    message = str(refused.value)
    assert "\n" not in message
    return message


def test_a_missing_or_unreadable_directory_is_refused_in_one_line(tmp_path: Path, model_dirs: dict[str, Path]) -> None:
    assert _refusal({"path": str(tmp_path / "nope")}) == (
        f"inference.backend.options.path: {tmp_path / 'nope'}: no such directory")
    (tmp_path / "empty").mkdir()
    assert "no config.json" in _refusal({"path": str(tmp_path / "empty")})
    broken = _copy(model_dirs["llama"], tmp_path / "broken")
    (broken / "config.json").unlink()
    (broken / "config.json").mkdir()  # there, but not readable as a file
    assert "config.json: cannot read" in _refusal({"path": str(broken)})
    unweighted = _copy(model_dirs["llama"], tmp_path / "unweighted")
    (unweighted / "model.safetensors").rename(unweighted / "pytorch_model.bin")
    assert "no *.safetensors weights (found pytorch_model.bin" in _refusal({"path": str(unweighted)})
    assert "options.path: the model directory is required" in _refusal({})


def test_an_architecture_that_is_not_a_causal_lm_is_refused(tmp_path: Path, model_dirs: dict[str, Path]) -> None:
    masked = _copy(model_dirs["llama"], tmp_path / "bert", model_type="bert", architectures=["BertForMaskedLM"])
    assert "architecture BertForMaskedLM is not a causal LM" in _refusal({"path": str(masked)})
    seq2seq = _copy(model_dirs["llama"], tmp_path / "t5", model_type="t5", is_encoder_decoder=True,
                    architectures=["T5ForConditionalGeneration"])
    assert "is an encoder-decoder, not a causal LM" in _refusal({"path": str(seq2seq)})


def test_a_context_longer_than_the_model_allows_is_refused_naming_the_limit(model_dirs: dict[str, Path]) -> None:
    message = _refusal({"path": str(model_dirs["llama"]), "max_context": 4096})
    assert message.startswith("inference.backend.options.max_context: 4096 is longer than the model allows: 512")
    assert "max_position_embeddings" in message


def test_weights_larger_than_the_device_budget_are_refused_before_loading(tmp_path: Path) -> None:
    big = make_tiny(tmp_path / "big", TinySpec(hidden_size=256, intermediate_size=512))
    message = _refusal({"path": str(big)}, device=DeviceContext(device=CPU, budget_bytes=1 << 20))
    assert message.startswith("device.memory_budget_mib: the weights of big (")
    assert "do not fit the device budget: 1.0 MiB left of 1.0 MiB" in message


def test_unknown_options_are_refused_naming_the_known_ones(model_dirs: dict[str, Path]) -> None:
    message = _refusal({"path": str(model_dirs["llama"]), "max_ctx": 64})
    assert message.startswith("inference.backend.options: unknown option(s) max_ctx; known: path, max_context")


# -- embeddings ---------------------------------------------------------------------------------
def _embed(service: InferenceService, model: str = "tiny-llama", **body: Any) -> Any:
    req = generation_pb2.GenerateRequest(model=model, prompt="x", max_tokens=1, api="openai.embeddings",
                                         body=json.dumps(body).encode())
    return service.Generate(req, LocalContext())


def test_an_hf_model_embeds_with_its_pooled_hidden_states_in_openais_shape(model_dirs: dict[str, Path]) -> None:
    service = _service(model_dirs["llama"], backend={"class": "hf", "options": {"path": str(model_dirs["llama"]),
                                                                                 "max_context": 64}})
    try:
        answer = json.loads(_embed(service, input=["Hello, world!", [5, 6, 7]]).body)
        first, second = (item["embedding"] for item in answer["data"])
        size = service.backend.model.module.config.hidden_size  # type: ignore[attr-defined]
        assert len(first) == len(second) == size and first != second
        assert abs(sum(x * x for x in first) - 1) < 1e-4
        assert answer["usage"]["prompt_tokens"] == len(service.backend.encode("Hello, world!")) + 3
        again = json.loads(_embed(service, input="Hello, world!", encoding_format="base64").body)
        assert isinstance(again["data"][0]["embedding"], str)  # little-endian float32, as the SDK decodes it
        for body, field in (({"input": "hi", "dimensions": 3}, "dimensions"), ({"input": []}, "input"),
                            ({"input": "Hello " * 80}, "input[0]"), ({"input": "hi", "encoding_format": "x"},
                                                                     "encoding_format")):
            with pytest.raises(LocalRpcError) as refused:
                _embed(service, **body)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.details().startswith(field), refused.value.details()
    finally:
        service.close()


def test_a_model_that_cannot_pool_refuses_embeddings_by_name() -> None:
    service = InferenceService(InferenceConfig.parse({"model_id": "tiny-lm", "max_batch": 2}),
                               DeviceContext(device=CPU))
    try:
        with pytest.raises(LocalRpcError) as refused:
            _embed(service, model="tiny-lm", input="hi")
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'tiny-lm' does not embed" in refused.value.details()
    finally:
        service.close()
