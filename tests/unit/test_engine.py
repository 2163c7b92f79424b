"""The generation engine: continuous batching, sampling, slots, and batch invariance."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from monolith.device import DeviceContext
from services.inference.model.engine import (
    GenerationEngine,
    GenerationRequest,
    SequenceHandle,
    SlotsExhausted,
)
from services.inference.model.interface import KV_CACHE_OWNER
from services.inference.model.tiny_lm import TinyLM
from services.inference.model.tokenizer import EOS_ID, ByteTokenizer

MODEL = TinyLM.from_seed(1234)
TOKENIZER = ByteTokenizer()
CONTEXT = 96


pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _engine(slots: int = 4, context: int = CONTEXT) -> GenerationEngine:
    return GenerationEngine(MODEL, TOKENIZER, "cpu", max_slots=slots, max_context=context)


def _req(
    prompt: str, max_tokens: int = 8, temperature: float = 0.0, seed: int | None = None
) -> GenerationRequest:
    return GenerationRequest(list(prompt.encode()), max_tokens, temperature, seed)


def _alone(req: GenerationRequest) -> tuple[list[int], str]:
    result = _engine(slots=1).generate([req])[0]
    return result.token_ids, result.finish_reason


def test_greedy_generation_is_deterministic_across_engines() -> None:
    first = _engine().generate([_req("Hello", 16)])[0]
    second = _engine().generate([_req("Hello", 16)])[0]
    assert first == second
    assert len(first.token_ids) == 16 and first.finish_reason == "length"


def test_seeded_sampling_is_deterministic() -> None:
    assert _alone(_req("Hi", 16, 1.0, seed=5)) == _alone(_req("Hi", 16, 1.0, seed=5))


def test_different_seeds_sample_different_answers() -> None:
    answers = {tuple(_alone(_req("Hi", 16, 1.0, seed=s))[0]) for s in range(4)}
    assert len(answers) == 4


def test_unseeded_sampling_draws_and_reports_a_random_seed() -> None:
    engine = _engine()
    a, b = engine.submit(_req("Hi", 4, 1.0)), engine.submit(_req("Hi", 4, 1.0))
    assert a.seed is not None and b.seed is not None and a.seed != b.seed
    assert engine.submit(_req("Hi", 4, 0.0)).seed is None


def test_max_tokens_is_respected() -> None:
    results = _engine().generate([_req("abc", n) for n in (1, 2, 7)])
    assert [len(r.token_ids) for r in results] == [1, 2, 7]
    assert all(r.finish_reason == "length" for r in results)


def test_eos_finishes_with_stop_and_frees_the_slot() -> None:
    seed = next(s for s in range(200) if _alone(_req("", 40, 1.5, seed=s))[1] == "stop")
    engine = _engine(slots=1)
    handle = engine.submit(_req("", 40, 1.5, seed=seed))
    outputs = []
    while not handle.finished:
        outputs += engine.step()
    last = outputs[-1]
    assert (last.token_id, last.finished, last.finish_reason) == (EOS_ID, True, "stop")
    assert all(not o.finished for o in outputs[:-1])
    assert EOS_ID not in handle.token_ids and len(handle.token_ids) == len(outputs) - 1
    assert engine.free_slots == 1 and engine.active_count == 0


def test_each_step_advances_every_active_sequence_by_one_token() -> None:
    engine = _engine()
    a, b = engine.submit(_req("one", 3)), engine.submit(_req("second prompt", 3))
    first = engine.step()
    assert [o.handle for o in first] == [a, b]
    assert len(a.token_ids) == len(b.token_ids) == 1
    c = engine.submit(_req("late", 3))
    assert [o.handle for o in engine.step()] == [a, b, c]


def test_full_pool_raises_slots_exhausted() -> None:
    engine = _engine(slots=2)
    engine.submit(_req("a"))
    engine.submit(_req("b"))
    assert engine.free_slots == 0
    with pytest.raises(SlotsExhausted, match="all 2 generation slots are busy"):
        engine.submit(_req("c"))


def test_finished_sequence_frees_its_slot_at_once() -> None:
    engine = _engine(slots=1)
    handle = engine.submit(_req("a", 1))
    [output] = engine.step()
    assert output.finished and output.finish_reason == "length" and handle.finished
    assert engine.free_slots == 1
    engine.submit(_req("b", 1))


def test_cancel_frees_the_slot_and_leaves_the_others_unaffected() -> None:
    engine = _engine(slots=3)
    keep = [_req("keep me", 10), _req("and me", 10, 0.9, seed=3)]
    kept = [engine.submit(r) for r in keep]
    doomed = engine.submit(_req("doomed", 10))
    engine.step()
    engine.step()
    engine.cancel(doomed)
    assert engine.free_slots == 1 and engine.active_count == 2
    assert doomed.finish_reason == "cancelled" and len(doomed.token_ids) == 2
    newcomer = engine.submit(_req("newcomer", 5, 1.2, seed=9))  # reuses the doomed slot
    assert newcomer.slot == doomed.slot
    while engine.active_count:
        assert doomed not in [o.handle for o in engine.step()]
    assert len(doomed.token_ids) == 2
    for handle, req in zip([*kept, newcomer], [*keep, _req("newcomer", 5, 1.2, seed=9)], strict=True):
        assert (handle.token_ids, handle.finish_reason) == _alone(req)
    engine.cancel(doomed)  # idempotent
    assert engine.free_slots == 3


def test_prompt_plus_max_tokens_beyond_context_is_a_value_error() -> None:
    engine = _engine(context=16)
    with pytest.raises(
        ValueError, match=r"prompt \(10 tokens\) \+ max_tokens \(7\) = 17 exceeds max_context 16"
    ):
        engine.submit(GenerationRequest([65] * 10, 7, 0.0))
    handle = engine.submit(GenerationRequest([65] * 10, 6, 0.0))  # exactly fits: BOS + 10 + 5 fed back
    while not handle.finished:
        engine.step()
    assert len(handle.token_ids) == 6


@pytest.mark.parametrize(
    ("req", "message"),
    [
        (GenerationRequest([65], 0), "max_tokens must be an integer >= 1, got 0"),
        (GenerationRequest([65], 4, -0.5), "temperature must be a finite number >= 0, got -0.5"),
        (GenerationRequest([65], 4, float("nan")), "temperature must be a finite number >= 0"),
        (GenerationRequest([300], 4), r"prompt_ids must be in 0\.\.257, got 300"),
    ],
)
def test_invalid_requests_are_refused_with_the_field_named(req: GenerationRequest, message: str) -> None:
    engine = _engine()
    with pytest.raises(ValueError, match=message):
        engine.submit(req)
    assert engine.free_slots == 4


def test_generate_queues_more_requests_than_slots() -> None:
    reqs = [_req(f"prompt {i}", 3 + i % 3, 0.8 * (i % 2), seed=i) for i in range(7)]
    results = _engine(slots=2).generate(reqs)
    assert [(r.token_ids, r.finish_reason) for r in results] == [_alone(r) for r in reqs]


def test_kv_cache_is_charged_to_the_device_budget_and_released_on_close() -> None:
    ctx = DeviceContext(device=torch.device("cpu"))
    engine = GenerationEngine(MODEL, TOKENIZER, ctx, max_slots=2, max_context=32)
    layers, heads, head_dim = MODEL.n_layers, MODEL.n_heads, MODEL.head_dim
    assert ctx.usage()[KV_CACHE_OWNER] == 2 * layers * 2 * 32 * heads * head_dim * 4
    assert engine.generate([_req("x", 3)])[0].token_ids == _alone(_req("x", 3))[0]
    engine.close()
    assert ctx.usage()[KV_CACHE_OWNER] == 0


def test_a_pool_beyond_the_device_budget_fails_at_construction() -> None:
    ctx = DeviceContext(device=torch.device("cpu"), budget_bytes=1024)
    with pytest.raises(MemoryError, match="inference.kv_cache"):
        GenerationEngine(MODEL, TOKENIZER, ctx, max_slots=2, max_context=32)


_REQUESTS = st.lists(
    st.tuples(
        st.text(alphabet="abc xyz!", max_size=12),  # prompt
        st.integers(1, 6),  # max_tokens
        st.sampled_from([0.0, 0.0, 0.7, 1.5]),  # temperature
        st.integers(0, 2**63 - 1),  # seed
        st.integers(0, 5),  # step at which it joins
    ),
    min_size=1,
    max_size=5,
)


@settings(max_examples=40, deadline=None)
@given(_REQUESTS)
def test_tokens_are_the_same_alone_or_batched_joining_at_any_step(
    specs: list[tuple[str, int, float, int, int]],
) -> None:
    engine = _engine(slots=len(specs))
    joining = sorted(range(len(specs)), key=lambda i: specs[i][4])
    handles: dict[int, SequenceHandle] = {}
    step = 0
    while joining or engine.active_count:
        while joining and specs[joining[0]][4] <= step:
            i = joining.pop(0)
            prompt, max_tokens, temperature, seed, _ = specs[i]
            handles[i] = engine.submit(_req(prompt, max_tokens, temperature, seed))
        engine.step()
        step += 1
    for i, (prompt, max_tokens, temperature, seed, _) in enumerate(specs):
        alone = _alone(_req(prompt, max_tokens, temperature, seed))
        assert (handles[i].token_ids, handles[i].finish_reason) == alone


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_gives_the_same_tokens_as_the_cpu() -> None:
    reqs = [_req("Hello", 24), _req("sampled", 24, 1.0, seed=11), _req("", 24, 0.7, seed=2)]
    on_cpu = _engine().generate(reqs)
    # The engine moves its model to its device: give it its own copy.
    on_cuda = GenerationEngine(TinyLM.from_seed(1234), TOKENIZER, "cuda", 4, CONTEXT).generate(reqs)
    assert on_cuda == on_cpu
