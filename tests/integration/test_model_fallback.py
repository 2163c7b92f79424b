"""Two models of different cost, a real fallback target, and a load hint on every answer.

The default config serves `tiny-lm` and the cheaper `tiny-lm-mini` from the one inference
component — each with its own engine, KV pool, scheduler and load hint, in both layouts —
and the router names the mini as the fallback of `tiny-lm`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from runtime.config.file import load_config
from runtime.running_stack import RunningStack
from services.inference.api import INFERENCE
from services.inference.load_hints import parse_load
from services.pipeline.interface import CallOptions
from spine.client.gateway_client import GatewayClient
from spine.client.overload_client import Backoff, Fallback, LoadAwareClient
from tests.conftest import DEV_KEY, TIGHT_KEY, config_for_tests, start_stack
from tests.waiting import eventually
from wire.v1 import generation_pb2, inference_pb2

LAYOUTS = ("collapsed", "layered")


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RunningStack]]:
    tmp = tmp_path_factory.mktemp("two-models")
    started: dict[str, RunningStack] = {}
    try:
        for layout in LAYOUTS:
            started[layout] = start_stack(layout, tmp)
        yield started
    finally:
        for stack in started.values():
            stack.stop()


def ask(model: str = "tiny-lm", prompt: str = "hello", max_tokens: int = 4) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(model=model, prompt=prompt, max_tokens=max_tokens)


def test_the_default_config_serves_two_models_and_names_the_fallback() -> None:
    config = load_config()
    assert [m.id for m in config.router.models] == ["tiny-lm", "tiny-lm-mini"]
    assert config.router.models[0].fallback == "tiny-lm-mini"
    assert [m.model_id for m in config.inference.models] == ["tiny-lm-mini"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_model_has_its_own_kv_pool_scheduler_and_hint(stacks: dict[str, RunningStack], layout: str) -> None:
    stack = stacks[layout]
    listed = stack.component(INFERENCE).models(inference_pb2.ModelInfoRequest(), CallOptions(timeout=10))
    loads = {model.id: parse_load(model.load) for model in listed.models}
    assert list(loads) == ["tiny-lm", "tiny-lm-mini"]
    assert loads["tiny-lm"]["slots"] == 16 and loads["tiny-lm-mini"]["slots"] == 8  # two pools
    with GatewayClient(stack.address, DEV_KEY) as client:
        big, mini = client.generate(ask("default", f"{layout} a")), client.generate(ask("mini", f"{layout} a"))
    assert big.ok and mini.ok and big.response.model == "tiny-lm" and mini.response.model == "tiny-lm-mini"
    assert big.load["slots"] == 16 and mini.load["slots"] == 8  # each answer, its own model's hint
    assert big.text != mini.text  # two different models
    if layout == "collapsed":
        served = stack.local_servicers["inference"].builtin
        assert set(served) == {"tiny-lm", "tiny-lm-mini"}
        assert served["tiny-lm"].engine is not served["tiny-lm-mini"].engine
        assert served["tiny-lm"].scheduler is not served["tiny-lm-mini"].scheduler
        per_slot = {name: service.kv_plan.per_slot_bytes for name, service in served.items()}
        assert per_slot["tiny-lm-mini"] * 4 == per_slot["tiny-lm"]  # the cheaper model's slots are smaller


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_answer_carries_a_load_hint_with_the_busy_fraction(stacks: dict[str, RunningStack], layout: str) -> None:
    stack = stacks[layout]
    with GatewayClient(stack.address, DEV_KEY) as client:
        first = client.generate(ask(prompt=f"hint {layout}"))
        answers = {
            "model": first,
            "cache hit": client.generate(ask(prompt=f"hint {layout}")),
            "stream": client.stream(ask(prompt=f"hint stream {layout}")),
            "unauthenticated": client.generate(ask(), token="not-a-key"),
            "unknown model": client.generate(ask("gpt-9")),
            "bad input": client.generate(ask(max_tokens=0)),
        }
    with GatewayClient(stack.address, TIGHT_KEY) as tight:
        for i in range(8):
            limited = tight.generate(ask(prompt=f"tight {layout} {i}"))
        answers["rate limited"] = limited
    assert answers["cache hit"].response.cached and answers["rate limited"].code == grpc.StatusCode.RESOURCE_EXHAUSTED
    for what, result in answers.items():
        load = result.load
        assert {"queue", "running", "slots", "kv_free", "busy"} <= set(load), (what, result.trailing)
        assert 0.0 <= load["busy"] <= 1.0
    assert answers["model"].trailing["x-spine-fallback"] == "tiny-lm-mini"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_fallbacks_answer_carries_its_primarys_load(stacks: dict[str, RunningStack], layout: str) -> None:
    with GatewayClient(stacks[layout].address, DEV_KEY) as client:
        mini = client.generate(ask("mini", f"primary load {layout}"))
    primary, _, hint = mini.trailing["x-spine-primary-load"].partition(":")
    assert primary == "tiny-lm" and parse_load(hint)["slots"] == 16
    assert "x-spine-fallback" not in mini.trailing


def test_the_helper_falls_back_to_the_mini_while_tiny_lm_is_full_and_comes_back(tmp_path: Path) -> None:
    """tiny-lm with one KV slot and one place in its queue, both taken by long requests: the
    helper's requests are refused (queue full), it falls back to the model the server names
    and is answered there; once tiny-lm is idle its hints turn calm and the helper goes back."""
    config = config_for_tests(inference={
        "backend": {"class": "tests.paced_backend:paced", "options": {"step_ms": 20}},
        "kv_cache_max_entries": 1, "max_batch": 1, "max_queue": 1, "warmup_tokens": 2,
        "models": [{"model_id": "tiny-lm-mini", "max_batch": 8, "max_queue": 256}]})
    stack = start_stack("collapsed", tmp_path, config)
    try:
        with GatewayClient(stack.address, DEV_KEY) as client:
            hogs = [threading.Thread(target=client.generate, args=(ask(prompt=f"hog {i}", max_tokens=100),))
                    for i in range(2)]
            tiny = stack.local_servicers["inference"].first  # tiny-lm's own service (the mini's beside it)
            placed = (lambda: tiny.engine.active_count == 1, lambda: tiny.scheduler.queue_depth == 1)
            for hog, holds in zip(hogs, placed, strict=True):  # the first holds the slot, the second the queue
                hog.start()
                eventually(holds, 10, f"{hog.name} in its place", interval=0.02)
            helper = LoadAwareClient(client, Backoff(attempts=1), Fallback(after=2, recover_after=2),
                                     sleep=lambda _: None)
            trail = [helper.generate(ask(prompt=f"helper {i}")) for i in range(3)]
            assert [r.code for r in trail[:2]] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2
            assert helper.using_fallback and helper.fallback_model == "tiny-lm-mini"
            assert trail[2].ok and trail[2].response.model == "tiny-lm-mini"
            for hog in hogs:
                hog.join(30)
            eventually(lambda: tiny.load_report().busy == 0.0, 10, "tiny-lm idle: its busy fraction 0",
                       interval=0.05, seen=tiny.load_report)
            back = [helper.generate(ask(prompt=f"helper back {i}")) for i in range(3)]
            assert [r.response.model for r in back] == ["tiny-lm-mini", "tiny-lm-mini", "tiny-lm"]
            assert not helper.using_fallback
    finally:
        stack.stop()
