"""Request limits sized per model: a model behind an engine with a long context takes requests
as long as its engine does (its context length read from the engine's /v1/models, or set in the
config), and a model whose context is not known keeps `limits.*`.

Real servers on 127.0.0.1: the spine (collapsed, in this process) and an OpenAI-compatible
upstream that lists its models as vLLM does (`tests.fault_upstream`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from runtime.config.file import load_config, placements_for
from runtime.running_stack import RunningStack
from runtime.stack import Stack
from services.common.engine_context import context_in
from tests.conftest import DEV_KEY, config_for_tests
from tests.fault_upstream import FaultUpstream
from tests.waiting import eventually

ENGINE_CONTEXT = 32768


@pytest.fixture(scope="module")
def spine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    tmp = tmp_path_factory.mktemp("limits")
    engine = FaultUpstream("http://127.0.0.1:9/v1", None, context_lengths={"brief": ENGINE_CONTEXT}).start()
    silent = FaultUpstream("http://127.0.0.1:9/v1", None, context_lengths={"brief": None}).start()
    routes = [{"id": "long", "aliases": ["agent"], "upstream": {"base_url": engine.base_url, "model": "brief"}},
              {"id": "sized", "context_length": 512, "upstream": {"base_url": engine.base_url, "model": "brief"}},
              {"id": "unknown", "upstream": {"base_url": silent.base_url, "model": "brief"}}]
    config = config_for_tests(router={"models": [*(m.model_dump(exclude_none=True) for m in load_config().router.models),
                                                 *routes]})
    stack = Stack(config, placements_for("collapsed", config), run_dir=tmp / "run", http_listen="127.0.0.1:0").start()
    try:
        yield stack
    finally:
        stack.stop()
        engine.stop()
        silent.stop()


def ask(stack: RunningStack, model: str, max_tokens: int, prompt_chars: int) -> Any:
    client = openai.OpenAI(base_url=f"http://{stack.http_address}/v1", api_key=DEV_KEY, max_retries=0)
    return client.chat.completions.create(model=model, max_tokens=max_tokens,
                                          messages=[{"role": "user", "content": "x" * prompt_chars}])


def accepted(stack: RunningStack, model: str, max_tokens: int, prompt_chars: int) -> bool:
    try:
        return ask(stack, model, max_tokens, prompt_chars).choices[0].message.content == "ok"
    except openai.BadRequestError:
        return False


def test_a_model_behind_a_long_context_engine_takes_long_requests(spine: RunningStack) -> None:
    """A 4,000-token answer to a 20,000-character prompt: refused by the default limits (256,
    2048), taken once the engine said its context is 32k (by the model's id and its alias)."""
    eventually(lambda: accepted(spine, "long", 4000, 20000), what="the engine's context length applied")
    assert accepted(spine, "agent", ENGINE_CONTEXT, 20000)
    with pytest.raises(openai.BadRequestError) as refused:
        ask(spine, "long", ENGINE_CONTEXT + 1, 10)
    assert (f"max_tokens: {ENGINE_CONTEXT + 1} is over the limit of {ENGINE_CONTEXT} for model 'long' "
            f"(its engine's context length, {ENGINE_CONTEXT} tokens)") in refused.value.message


def test_a_context_length_set_in_the_config_wins_over_the_engines(spine: RunningStack) -> None:
    assert accepted(spine, "sized", 512, 4000)
    with pytest.raises(openai.BadRequestError) as refused:
        ask(spine, "sized", 513, 10)
    assert "over the limit of 512 for model 'sized' (its context length, 512 tokens)" in refused.value.message


def test_a_model_whose_context_is_not_known_keeps_the_limits_section(spine: RunningStack) -> None:
    assert accepted(spine, "unknown", 256, 2048)
    for tokens, chars in ((257, 10), (16, 2049)):
        with pytest.raises(openai.BadRequestError) as refused:
            ask(spine, "unknown", tokens, chars)
        assert "(limits.max_tokens / limits.max_prompt_chars)" in refused.value.message


@pytest.mark.parametrize(("listing", "length"), [
    ({"data": [{"id": "m", "max_model_len": 8192}]}, 8192),  # vLLM
    ({"data": [{"id": "m.gguf", "meta": {"n_ctx_train": 4096}}]}, 4096),  # llama.cpp's server, one model
    ({"data": [{"id": "other", "context_length": 100}, {"id": "m", "context_window": 131072}]}, 131072),
    ({"data": [{"id": "other", "context_length": 100}, {"id": "x"}]}, None),
    ({"object": "list"}, None),
])
def test_the_context_length_is_read_from_what_engines_list(listing: dict[str, Any], length: int | None) -> None:
    assert context_in(listing, "m") == length
