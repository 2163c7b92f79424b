"""The embedded model: tokenizer, seeded weights, exact cached forward, backend loading."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common import ConfigError
from services.inference.model.backend import (
    ModuleStepModel,
    TinyLMBackend,
    TokenizedBackend,
    load_backend,
    make_engine,
)
from services.inference.model.engine import GenerationRequest
from services.inference.model.interface import Segment
from services.inference.model.tiny_lm import PRINTABLE, TinyLM
from services.inference.model.tokenizer import BOS_ID, EOS_ID, VOCAB_SIZE, ByteTokenizer

MODEL = TinyLM.from_seed(1234)
CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _weights(model: TinyLM) -> dict[str, torch.Tensor]:
    return dict(model.state_dict())


@given(st.text(max_size=200))
def test_tokenizer_round_trips_any_text(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text


def test_tokenizer_drops_specials_and_replaces_broken_utf8() -> None:
    tok = ByteTokenizer()
    assert tok.vocab_size == VOCAB_SIZE == 258
    assert tok.decode([BOS_ID, *b"hi", EOS_ID]) == "hi"
    assert tok.decode([0xE2, 0x82]) == "\ufffd"


def test_same_seed_gives_bit_identical_weights() -> None:
    a, b = _weights(TinyLM.from_seed(7)), _weights(TinyLM.from_seed(7))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_other_seed_gives_other_weights() -> None:
    a, b = _weights(TinyLM.from_seed(7)), _weights(TinyLM.from_seed(8))
    assert all(not torch.equal(a[k], b[k]) for k in a)


def test_weights_do_not_touch_global_rng_state() -> None:
    state = torch.get_rng_state()
    TinyLM.from_seed(99)
    assert torch.equal(state, torch.get_rng_state())


def test_weights_sit_on_the_fixed_point_grid() -> None:
    for name, tensor in _weights(MODEL).items():
        scaled = tensor * 2**14
        assert torch.equal(scaled, scaled.round()), name
        assert tensor.abs().max() <= 1.0, name


def test_dimensions_beyond_the_exact_arithmetic_budget_are_refused() -> None:
    with pytest.raises(ValueError, match="max_context must be in 1..65536"):
        TinyLM(max_context=1 << 17)
    with pytest.raises(ValueError, match="d_model"):
        TinyLM(d_model=1024, n_heads=4)
    with pytest.raises(ValueError, match="multiple of n_heads"):
        TinyLM(d_model=66, n_heads=4)


def test_logits_allow_only_printable_bytes_and_eos() -> None:
    logits = MODEL([Segment(0, 0, (BOS_ID, *b"hello"))], None, all_logits=True)
    allowed = torch.zeros(VOCAB_SIZE, dtype=torch.bool)
    allowed[PRINTABLE] = True
    allowed[EOS_ID] = True
    assert torch.isfinite(logits[:, allowed]).all()
    assert torch.isneginf(logits[:, ~allowed]).all()


@settings(max_examples=30, deadline=None)
@given(
    ids=st.lists(st.integers(0, 255), min_size=1, max_size=40),
    split=st.integers(1, 40),
)
def test_cached_decode_equals_full_recompute_bit_for_bit(ids: list[int], split: int) -> None:
    seq = [BOS_ID, *ids]
    split = min(split, len(seq))
    full = MODEL([Segment(0, 0, tuple(seq))], None, all_logits=True)
    cache = MODEL.new_cache(3, 64, CPU)
    rows = [MODEL([Segment(2, 0, tuple(seq[:split]))], cache, all_logits=True)]
    rows += [MODEL([Segment(2, i, (seq[i],))], cache) for i in range(split, len(seq))]
    assert torch.equal(torch.cat(rows), full)


@settings(max_examples=30, deadline=None)
@given(
    target=st.lists(st.integers(0, 255), min_size=1, max_size=30),
    others=st.lists(st.lists(st.integers(0, 255), min_size=1, max_size=30), max_size=4),
)
def test_logits_of_a_sequence_do_not_depend_on_its_batch(target: list[int], others: list[list[int]]) -> None:
    alone = MODEL([Segment(0, 0, (BOS_ID, *target))], MODEL.new_cache(1, 64, CPU))
    cache = MODEL.new_cache(len(others) + 1, 64, CPU)
    # Fill the target's slot with a stale sequence first: a new sequence must not see it.
    MODEL([Segment(len(others), 0, tuple(range(40)))], cache)
    segments = [Segment(i, 0, (BOS_ID, *o)) for i, o in enumerate(others)]
    segments.append(Segment(len(others), 0, (BOS_ID, *target)))
    batched = MODEL(segments, cache)
    assert torch.equal(batched[-1], alone[0])


def test_a_long_prompt_is_prefilled_in_chunks_exactly() -> None:
    ids = (BOS_ID, *(b"abcdefghij" * 30))
    full = MODEL([Segment(0, 0, ids)], None, all_logits=True)
    cached = MODEL([Segment(0, 0, ids)], MODEL.new_cache(1, 512, CPU), all_logits=True)
    assert torch.equal(full, cached)


def test_forward_refuses_a_segment_past_the_cache() -> None:
    cache = MODEL.new_cache(1, 8, CPU)
    with pytest.raises(ValueError, match="spans 5..10; needs 1..8"):
        MODEL([Segment(0, 5, (1, 2, 3, 4, 5))], cache)


def test_load_backend_builds_the_tiny_lm_from_its_seed() -> None:
    backend = load_backend({"model_id": "tiny-lm", "seed": 1234, "max_batch": 16})
    assert isinstance(backend, TinyLMBackend) and isinstance(backend.model, TinyLM)
    assert backend.id == "tiny-lm" and backend.max_context == 1024
    assert backend.decode(backend.encode("héllo")) == "héllo"
    assert all(
        torch.equal(a, b)
        for a, b in zip(_weights(backend.model).values(), _weights(MODEL).values(), strict=True)
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"model_id": "gpt-9"}, "inference.model_id: unknown model 'gpt-9'"),
        ({"seed": "abc"}, "inference.seed: expected an integer, got 'abc'"),
        ({"max_context": 1}, "inference.max_context: expected an integer >= 2, got 1"),
        ({"max_context": 1 << 20}, "inference: max_context must be in 1..65536"),
        ({"class": "nodots"}, "inference.class: expected 'package.module:Factory'"),
        ({"class": "no_such_pkg.mod:F"}, "inference.class: cannot import 'no_such_pkg.mod:F'"),
        ({"class": "tests.unit.test_model:not_a_backend"}, "returned dict, which is not a ModelBackend"),
    ],
)
def test_load_backend_names_the_bad_field(spec: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        load_backend(spec)


class _CountingModule(torch.nn.Module):
    """A user's model: the next byte is the last one plus one (no KV cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        nxt = (ids + 1) % 256
        return torch.nn.functional.one_hot(nxt, VOCAB_SIZE).to(torch.float32) * 10


def user_backend(max_context: int = 64) -> TokenizedBackend:
    return TokenizedBackend(
        "counter", ModuleStepModel(_CountingModule(), VOCAB_SIZE, max_context), ByteTokenizer()
    )


def not_a_backend() -> dict[str, str]:
    return {"id": "nope"}


def test_a_user_model_loads_from_a_dotted_path_and_generates() -> None:
    backend = load_backend({"class": "tests.unit.test_model:user_backend", "options": {"max_context": 32}})
    assert backend.id == "counter" and backend.max_context == 32
    engine = make_engine(backend, "cpu", max_slots=2)
    results = engine.generate(
        [GenerationRequest(backend.encode("a"), 3, 0.0), GenerationRequest(backend.encode("x"), 2, 0.0)]
    )
    assert [backend.decode(r.token_ids) for r in results] == ["bcd", "yz"]
