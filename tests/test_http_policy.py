"""The output policy over HTTP: a configured phrase in the answer is the seed's error,
`{"error": "content_policy_violation", "suggestion": "rephrase"}`, in both layouts and APIs,
and a stream stops before the chunk that would complete the phrase."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spine.runtime.config import placements_for
from spine.runtime.stack import Stack
from tests.conftest import DEV_KEY
from tests.http_helpers import http_config, raw, sse_events

PROMPT = "a probe for the output policy over http"
AUTH = {"authorization": f"Bearer {DEV_KEY}"}


def chat(prompt: str, stream: bool = False) -> dict[str, Any]:
    return {"model": "tiny-lm", "max_tokens": 24, "temperature": 0, "stream": stream,
            "messages": [{"role": "user", "content": prompt}]}


def start(layout: str, tmp: Path, config: dict[str, Any]) -> Stack:
    stack = Stack(config, placements_for(layout, config), run_dir=tmp / layout, http_listen="127.0.0.1:0")
    stack.start()
    return stack


@pytest.fixture(scope="module")
def phrase(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Five characters the model's greedy answer to PROMPT holds (and its other answers here do not)."""
    stack = start("collapsed", tmp_path_factory.mktemp("probe"), http_config())
    try:
        with raw(stack) as client:
            text = client.post("/v1/chat/completions", headers=AUTH, json=chat(PROMPT)).json()[
                "choices"][0]["message"]["content"]
            other = client.post("/v1/chat/completions", headers=AUTH, json=chat("an innocent one")).json()[
                "choices"][0]["message"]["content"]
    finally:
        stack.stop()
    for begin in range(8, len(text) - 4):  # not in the first chunks: the stream must have begun
        piece = text[begin:begin + 5]
        if piece.strip() and piece.isprintable() and piece not in other:
            return piece
    raise AssertionError(f"no phrase of its own in {text!r}")


@pytest.fixture(scope="module")
def stacks(phrase: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Stack]]:
    config = {**http_config(), "output_policy": {"rules": [{"name": "probe", "phrases": [phrase]}]}}
    tmp = tmp_path_factory.mktemp("policy")
    running: dict[str, Stack] = {}
    try:
        for layout in ("collapsed", "layered"):
            running[layout] = start(layout, tmp, config)
        yield running
    finally:
        for stack in running.values():
            stack.stop()


@pytest.mark.parametrize("layout", ["collapsed", "layered"])
def test_a_policy_violation_is_the_seeds_error_in_both_apis(stacks: dict[str, Stack], phrase: str,
                                                             layout: str) -> None:
    with raw(stacks[layout]) as client:
        plain = client.post("/v1/chat/completions", headers=AUTH, json=chat(PROMPT))
        message = client.post("/v1/messages", headers={"x-api-key": DEV_KEY},
                              json={**chat(PROMPT), "stream": False})
        fine = client.post("/v1/chat/completions", headers=AUTH, json=chat("an innocent one"))
        streamed = client.post("/v1/chat/completions", headers=AUTH, json=chat(PROMPT, stream=True))
    assert fine.status_code == 200
    for answer in (plain, message):
        assert answer.status_code == 400, answer.text
        body = answer.json()
        assert body["error"] == "content_policy_violation" and body["suggestion"] == "rephrase"
        assert phrase not in answer.text
    assert streamed.status_code == 200  # admitted: the violation comes after the stream began
    events = [json.loads(data) for _, data in sse_events(streamed.text) if data != "[DONE]"]
    assert events[-1]["error"] == "content_policy_violation" and events[-1]["suggestion"] == "rephrase"
    released = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e.get("choices"))
    assert phrase not in released and "[DONE]" not in streamed.text
