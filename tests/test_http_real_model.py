"""A real instruct model over the HTTP API: the OpenAI chat endpoint renders the conversation
with SmolLM2's own chat template, the answer names Paris and ends at the model's stop token,
and both layouts answer alike (parity)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import anthropic
import openai

from tests.conftest import DEV_KEY
from tests.test_real_model import smollm2  # noqa: F401  (the converted model, shared by the suite)

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def ask(layout: str, model_dir: Path, run_dir: Path) -> tuple[str, str | None, str]:
    """(chat answer, its finish reason, the Messages API's answer) from `spine up --model` in `layout`."""
    process = subprocess.Popen(
        [sys.executable, "-m", "spine", "up", "--layout", layout, "--listen", "127.0.0.1:0",
         "--http-listen", "127.0.0.1:0", "--run-dir", str(run_dir), "--model", str(model_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line, process.stderr.read() if process.stderr else ""
        address = json.loads(line)["http_address"]
        chat = openai.OpenAI(base_url=f"http://{address}/v1", api_key=DEV_KEY, max_retries=0, timeout=120)
        answer = chat.chat.completions.create(model="default", messages=QUESTION, max_tokens=16, temperature=0)
        message = anthropic.Anthropic(base_url=f"http://{address}", api_key=DEV_KEY, max_retries=0,
                                      timeout=120).messages.create(
            model="default", messages=QUESTION, max_tokens=16, extra_body={"temperature": 0})
        return answer.choices[0].message.content or "", answer.choices[0].finish_reason, message.content[0].text
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)


def test_the_openai_chat_endpoint_answers_paris_through_the_models_template_in_both_layouts(
        smollm2: Path, tmp_path: Path) -> None:  # noqa: F811
    answers = {layout: ask(layout, smollm2, tmp_path / layout) for layout in ("collapsed", "layered")}
    text, finish, message = answers["collapsed"]
    assert "Paris" in text and finish == "stop", answers  # the template's turn, ended at <|im_end|>
    assert message == text  # the same chat through the Anthropic API
    assert answers["layered"] == answers["collapsed"]
