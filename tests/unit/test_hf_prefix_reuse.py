"""A shared system prompt's KV on the transformers backend: computed once, copied into later slots.

Specifications (`services.inference.model.kv_prefix`): in deterministic mode the answers with reuse are
the answers without it, token for token; a reused prefix is not prefilled again (the model
forwards fewer tokens, the hit is counted, in the engine and on /metrics); the stored copy
is charged to the device budget beside the pool, stays within its own budget by evicting
the least recently used entry, and comes back when the engine closes; the shared part is
exactly the tokens the system prompt alone decides, in the chat template's rendering.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from prometheus_client.exposition import generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from monolith.device import DeviceContext  # noqa: E402
from services.inference.model.backend import make_engine  # noqa: E402
from services.inference.model.engine import GenerationEngine, GenerationRequest  # noqa: E402
from services.inference.model.hf_backend import HFBackend, load_hf_backend  # noqa: E402
from services.inference.model.interface import KV_CACHE_OWNER, Segment  # noqa: E402
from services.inference.service import InferenceConfig, InferenceService  # noqa: E402
from services.pipeline.local_context import LocalContext  # noqa: E402
from spine.tools.model.make_tiny import TinySpec, make_tiny  # noqa: E402
from wire.v1 import generation_pb2  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")

CPU = torch.device("cpu")
SYSTEMS = ["You are the support assistant of a small bookshop. Answer politely, in one short sentence.",
           "Be brief."]
PROMPTS = ["Hello, world!", "What is the time?", "a", "Numbers: 1 2 3", "How are you today?"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("hf-prefix") / "tiny-llama", TinySpec(arch="llama"))


@pytest.fixture(scope="module")
def backend(model_dir: Path) -> HFBackend:
    return load_hf_backend({"path": str(model_dir)})


@pytest.fixture
def deterministic() -> Iterator[None]:
    """What `inference.deterministic: true` switches on (and with it, per-sequence steps)."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def _request(backend: HFBackend, prompt: str, system: str, max_tokens: int = 8, **fields: Any) -> GenerationRequest:
    prefix, ids = backend.encode_chat_parts(prompt, system)
    return GenerationRequest(prompt_ids=ids, prefix_ids=prefix, max_tokens=max_tokens, **fields)


def _forwarded_tokens(backend: HFBackend) -> tuple[list[int], Any]:
    """A running count of the token positions the transformers module computes (a forward hook)."""
    count = [0]

    def hook(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        count[0] += int(kwargs["input_ids"].numel())

    return count, backend.model.module.register_forward_pre_hook(hook, with_kwargs=True)


def _serve(engine: GenerationEngine, requests: list[GenerationRequest]) -> list[list[int]]:
    """One request alone (its prefix stored), then all of them together: later ones hit."""
    engine.generate(requests[:1])
    return [answer.token_ids for answer in engine.generate(requests)]


# -- the same answers ------------------------------------------------------------------------------
@pytest.mark.usefixtures("deterministic")
def test_greedy_and_seeded_answers_are_identical_with_and_without_prefix_reuse(backend: HFBackend) -> None:
    requests = [_request(backend, prompt, SYSTEMS[i % 2], 6 + i) for i, prompt in enumerate(PROMPTS)]
    requests.append(_request(backend, "Tell me a story", SYSTEMS[0], 10, temperature=0.9, seed=7))
    answers = {}
    for reuse in (True, False):
        engine = make_engine(backend, CPU, 3, prefix_caching=reuse)
        try:
            answers[reuse] = _serve(engine, requests)
            if reuse:
                assert engine.prefixes is not None and engine.prefixes.hits >= len(requests) - 2
            else:
                assert engine.prefixes is None
        finally:
            engine.close()
    assert answers[True] == answers[False]
    assert all(answers[True])


def test_per_sequence_logits_are_bit_identical_with_a_copied_prefix(backend: HFBackend) -> None:
    """Not only the tokens: the logits. The prefix is forwarded apart (`Segment.prefix`), so its
    keys are the same from any request, and the rest reads the same keys either way."""
    model = backend.model
    model.batch_invariant = True
    other, request = (_request(backend, prompt, SYSTEMS[0]) for prompt in ("Hello, world! More words", "a"))
    shared = 1 + len(request.prefix_ids)
    first, tokens = ((backend.tokenizer.bos_id, *r.prefix_ids, *r.prompt_ids) for r in (other, request))
    cache = model.new_cache(3, 128, CPU)
    try:
        model.step([Segment(0, 0, first, shared)], cache)  # another request computes the prefix
        stored = model.save_prefix(cache, 0, shared, CPU)
        model.load_prefix(stored, cache, 1)
        reused = model.step([Segment(1, shared, tokens[shared:])], cache)
        computed = model.step([Segment(2, 0, tokens, shared)], cache)
        assert torch.equal(reused, computed)
        for (key, value), keys, values in zip(stored, cache.keys, cache.values, strict=True):
            assert torch.equal(keys[2, :, :shared], key) and torch.equal(values[2, :, :shared], value)
    finally:
        model.batch_invariant = None
        model.release_cache(cache, CPU)


@pytest.mark.usefixtures("deterministic")
def test_a_reused_prefix_answers_as_the_models_own_full_forward(backend: HFBackend) -> None:
    request = _request(backend, "What is the time?", SYSTEMS[0], 8)
    ids = [backend.tokenizer.bos_id, *request.prefix_ids, *request.prompt_ids]
    expected: list[int] = []
    with torch.inference_mode():
        for _ in range(request.max_tokens):
            token = int(torch.argmax(backend.model.module(torch.tensor([ids])).logits[0, -1]))
            if token in backend.tokenizer.stop_ids:
                break
            expected.append(token)
            ids.append(token)
    engine = make_engine(backend, CPU, 2)
    try:
        first, second = engine.generate([request])[0], engine.generate([request])[0]
        assert engine.prefixes is not None and engine.prefixes.hits == 1
    finally:
        engine.close()
    assert first.token_ids == second.token_ids == expected


# -- the prefill is skipped -------------------------------------------------------------------------
@pytest.mark.usefixtures("deterministic")
def test_a_reused_prefix_is_not_prefilled_again(backend: HFBackend) -> None:
    cold, warm = (_request(backend, prompt, SYSTEMS[0], 1) for prompt in ("Hello, world!", "What is the time?"))
    shared = 1 + len(cold.prefix_ids)  # BOS and the system prompt's tokens
    assert shared > 10 and warm.prefix_ids == cold.prefix_ids
    count, hook = _forwarded_tokens(backend)
    engine = make_engine(backend, CPU, 2)
    try:
        first = engine.submit(cold)
        engine.step()
        assert count[0] == shared + len(cold.prompt_ids) and first.reused_tokens == 0
        count[0] = 0
        second = engine.submit(warm)
        engine.step()
        assert second.reused_tokens == shared
        assert count[0] == len(warm.prompt_ids)  # only what follows the system prompt
        assert engine.prefixes is not None
        assert (engine.prefixes.hits, engine.prefixes.misses, len(engine.prefixes)) == (1, 1, 1)
    finally:
        hook.remove()
        engine.close()


def test_without_reuse_every_request_prefills_its_system_prompt(backend: HFBackend) -> None:
    requests = [_request(backend, prompt, SYSTEMS[0], 1) for prompt in PROMPTS[:2]]
    count, hook = _forwarded_tokens(backend)
    engine = make_engine(backend, CPU, 2, prefix_caching=False)
    try:
        engine.generate(requests[:1])
        engine.generate(requests[1:])
    finally:
        hook.remove()
        engine.close()
    assert count[0] == sum(1 + len(r.prefix_ids) + len(r.prompt_ids) for r in requests)


# -- memory: charged, bounded, evicted, returned ---------------------------------------------------------
def test_stored_prefixes_are_charged_to_the_device_budget_evicted_lru_and_returned(backend: HFBackend) -> None:
    long, short = (_request(backend, "Hello, world!", system, 1) for system in SYSTEMS)
    per_token = backend.model.prefix_bytes(1)
    long_bytes, short_bytes = ((1 + len(r.prefix_ids)) * per_token for r in (long, short))
    device = DeviceContext(device=CPU, budget_bytes=64 << 20)
    # Room for the long prefix or the short one, not both.
    engine = GenerationEngine(backend.model, backend.tokenizer, device, 2, 128, prefix_budget_bytes=long_bytes)
    pool = 2 * backend.model.kv_bytes_per_slot(128)
    store = engine.prefixes
    assert store is not None
    try:
        engine.generate([long])
        assert (store.bytes, len(store)) == (long_bytes, 1)
        assert device.usage()[KV_CACHE_OWNER] == pool + long_bytes
        engine.generate([short])  # the long one goes: least recently used
        assert (store.bytes, len(store), store.evictions) == (short_bytes, 1, 1)
        assert device.usage()[KV_CACHE_OWNER] == pool + short_bytes
        engine.generate([long])
        assert store.misses == 3 and store.hits == 0
    finally:
        engine.close()
    assert device.usage()[KV_CACHE_OWNER] == 0


def test_a_prefix_larger_than_its_budget_is_served_but_not_stored(backend: HFBackend) -> None:
    request = _request(backend, "Hello, world!", SYSTEMS[0], 4)
    engine = make_engine(backend, CPU, 2, prefix_budget_bytes=backend.model.prefix_bytes(len(request.prefix_ids)))
    try:
        answers = [engine.generate([request])[0].token_ids for _ in range(2)]
        assert engine.prefixes is not None
        assert (len(engine.prefixes), engine.prefixes.refused, engine.prefixes.hits) == (0, 2, 0)
    finally:
        engine.close()
    assert answers[0] == answers[1] and len(answers[0]) == 4


# -- the shared part of the chat template's rendering ------------------------------------------------------
def test_the_shared_part_is_what_the_system_prompt_alone_decides(backend: HFBackend) -> None:
    vocab = backend.tokenizer.hf.get_vocab()
    parts = [backend.encode_chat_parts(prompt, SYSTEMS[0]) for prompt in PROMPTS]
    for (prefix, rest), prompt in zip(parts, PROMPTS, strict=True):
        assert prefix + rest == backend.encode_chat(prompt, SYSTEMS[0])
        assert prefix == parts[0][0]
    assert parts[0][0][0] == vocab["<|system|>"] and parts[0][0][-1] == vocab["<|user|>"]
    assert backend.encode_chat_parts("Hi", None) == ([], backend.encode_chat("Hi"))
    other, _ = backend.encode_chat_parts("Hello, world!", SYSTEMS[1])
    assert other != parts[0][0]
    messages = [{"role": "system", "content": SYSTEMS[0]}, {"role": "user", "content": "Hello, world!"}]
    assert backend.encode_messages_parts(messages) == parts[0]


# -- the service -----------------------------------------------------------------------------------------
def _service(path: Path, **config: Any) -> InferenceService:
    section = {"model_id": "tiny-llama", "max_batch": 4, "deterministic": True,
               "backend": {"class": "hf", "options": {"path": str(path)}}, **config}
    return InferenceService(InferenceConfig.parse(section), DeviceContext(device=CPU))


def _metric(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    raise KeyError(name)


def test_the_service_reuses_a_system_prompt_with_the_same_answers_and_counts_it(model_dir: Path) -> None:
    answers: dict[bool, list[list[int]]] = {}
    for reuse in (True, False):
        service = _service(model_dir, prefix_cache=reuse)
        try:
            answers[reuse] = []
            for prompt in PROMPTS[:3]:
                request = generation_pb2.GenerateRequest(model="tiny-llama", prompt=prompt, max_tokens=6,
                                                         system=SYSTEMS[0])
                answer = service.Generate(request, LocalContext())
                assert answer.prompt_tokens == len(service.backend.encode_chat(prompt, SYSTEMS[0]))  # type: ignore[attr-defined]
                answers[reuse].append(list(answer.token_ids))
            text = generate_latest(service.metrics_registry).decode()
        finally:
            service.close()
        if reuse:
            assert _metric(text, "spine_prefix_cache_lookups_total", model="tiny-llama", result="hit") == 2
            assert _metric(text, "spine_prefix_cache_lookups_total", model="tiny-llama", result="miss") == 1
            assert _metric(text, "spine_prefix_cache_bytes", model="tiny-llama") > 0
        else:
            with pytest.raises(KeyError):
                _metric(text, "spine_prefix_cache_bytes", model="tiny-llama")
    assert answers[True] == answers[False]
