"""Shared prefixes (system prompts) in the KV pool: kept once, reference-counted, evicted LRU,
and never a different answer."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.inference.model.engine import GenerationEngine, GenerationRequest
from services.inference.model.kv_pool import BlockPool, PagedKV
from services.inference.model.tiny_kv import KV_BLOCK_TOKENS
from services.inference.model.tiny_lm import TinyLM
from services.inference.model.tokenizer import ByteTokenizer

MODEL = TinyLM.from_seed(1234)
TOKENIZER = ByteTokenizer()
SYSTEM = list(b"You are a terse assistant. Answer in one line, in plain English, and stop. ")

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _engine(slots: int = 4, context: int = 256, prefix_caching: bool = True) -> GenerationEngine:
    return GenerationEngine(MODEL, TOKENIZER, "cpu", slots, context, prefix_caching=prefix_caching)


def _req(prompt: str, system: list[int] = SYSTEM, max_tokens: int = 6, **kw: object) -> GenerationRequest:
    return GenerationRequest(list(prompt.encode()), max_tokens, prefix_ids=system, **kw)  # type: ignore[arg-type]


@settings(max_examples=25, deadline=None)
@given(
    system=st.lists(st.integers(32, 126), min_size=0, max_size=70),
    prompts=st.lists(st.lists(st.integers(32, 126), min_size=1, max_size=12), min_size=1, max_size=6),
    slots=st.integers(1, 4),
    temperature=st.sampled_from([0.0, 0.9]),
)
def test_answers_are_identical_with_and_without_prefix_reuse(
    system: list[int], prompts: list[list[int]], slots: int, temperature: float
) -> None:
    """Deterministic mode's promise: reusing a cached system prompt changes no token, in any batch."""
    def answers(**engine: object) -> list[list[int]]:
        requests = [GenerationRequest(p, 5, temperature, seed=7, prefix_ids=system) for p in prompts]
        return [r.token_ids for r in _engine(slots, 128, **engine).generate(requests)]  # type: ignore[arg-type]

    joined = [GenerationRequest(system + p, 5, temperature, seed=7) for p in prompts]
    plain = [r.token_ids for r in _engine(1, 128, prefix_caching=False).generate(joined)]
    assert answers(prefix_caching=True) == answers(prefix_caching=False) == plain


def test_sequences_with_one_system_prompt_hold_its_blocks_once() -> None:
    engine = _engine(slots=4)
    handles = [engine.submit(_req(f"q{i}")) for i in range(4)]
    assert engine.kv is not None
    shared = (1 + len(SYSTEM)) // KV_BLOCK_TOKENS
    tables = [engine.kv.cache.tables[h.slot] for h in handles]
    assert all(t[:shared] == tables[0][:shared] for t in tables)
    assert len({b for t in tables for b in t[shared:]}) == sum(len(t) - shared for t in tables)
    assert engine.kv.pool.in_use == shared + sum(len(t) - shared for t in tables)


def test_a_ready_prefix_is_not_prefilled_again() -> None:
    engine = _engine()
    first = engine.submit(_req("first"))
    engine.step()
    later = engine.submit(_req("later"))
    aligned = ((1 + len(SYSTEM)) // KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS
    assert first.reused_tokens == 0 and later.reused_tokens == aligned
    assert later._cached == aligned and len(later._pending) == 1 + len(SYSTEM) + len(b"later") - aligned


def test_a_finished_sequence_leaves_its_prefix_cached_until_room_is_needed() -> None:
    engine = _engine(slots=2, context=256)
    assert engine.kv is not None
    engine.generate([_req("one")])
    usage = engine.kv.usage()
    assert usage["used"] == 0 and usage["cached"] == (1 + len(SYSTEM)) // KV_BLOCK_TOKENS
    # Two long requests with another system prompt need every block: the unused entry goes.
    other = list(b"Another system prompt altogether. " * 2)
    engine.generate([_req("a", other, max_tokens=256 - len(other) - 2), _req("b", [], max_tokens=250)])
    assert engine.kv.prefixes.evictions >= 1
    assert engine.kv.pool.free == engine.kv.pool.count - engine.kv.prefixes.cached_blocks()


def test_eviction_takes_the_least_recently_used_unused_prefix() -> None:
    engine = _engine(slots=1, context=128)  # 8 blocks of 16 positions
    assert engine.kv is not None
    systems = [list(f"System prompt number {i} for the eviction test.".encode()) for i in range(3)]
    for system in (*systems, systems[0]):  # 0 is used again: 1 is now the least recent, then 2
        engine.generate([_req("x", system, max_tokens=2)])
    assert engine.kv.usage() == {"used": 0, "cached": 6, "free": 2}
    engine.generate([_req("y", [], max_tokens=95)])  # BOS + "y" + 94 positions: 6 blocks
    assert list(engine.kv.prefixes._entries) == [tuple([TOKENIZER.bos_id, *systems[0]][:32])]
    assert engine.kv.prefixes.evictions == 2


def test_a_prefix_whose_sequences_all_failed_is_forgotten() -> None:
    engine = _engine()
    assert engine.kv is not None
    handle = engine.submit(_req("never run"))
    engine.cancel(handle)
    assert len(engine.kv.prefixes) == 0 and engine.kv.pool.in_use == 0


def test_without_prefix_caching_every_sequence_holds_its_own_copy() -> None:
    engine = _engine(prefix_caching=False)
    assert engine.kv is not None
    handles = [engine.submit(_req(f"q{i}")) for i in range(3)]
    tables = [engine.kv.cache.tables[h.slot] for h in handles]
    assert not set(tables[0]) & set(tables[1]) and engine.kv.pool.in_use == sum(map(len, tables))


def test_block_pool_counts_references() -> None:
    pool = BlockPool(4)
    blocks = pool.take(2)
    pool.share(blocks)
    pool.drop(blocks)
    assert pool.free == 2
    pool.drop(blocks)
    assert pool.free == 4 and pool.peak == 2
    with pytest.raises(MemoryError, match="5 KV blocks asked for, 4 free of 4"):
        pool.take(5)


def test_paged_kv_refuses_what_cannot_fit() -> None:
    kv = PagedKV(MODEL.new_cache(1, 32, torch.device("cpu")))
    kv.admit(0, [0, *range(40, 50)], 1, 32)
    with pytest.raises(MemoryError):
        kv.admit(0, [0, 1], 1, 32)
