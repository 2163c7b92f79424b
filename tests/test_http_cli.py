"""`spine up` serves the HTTP API in both layouts and names it in its ready line."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import anthropic
import openai
import pytest

from tests.conftest import DEV_KEY


@pytest.mark.parametrize("layout", ["layered", "collapsed"])
def test_spine_up_prints_http_address_and_the_sdks_get_answers(tmp_path: Path, layout: str) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "spine", "up", "--layout", layout, "--listen", "127.0.0.1:0",
         "--http-listen", "127.0.0.1:0", "--run-dir", str(tmp_path / "run")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line, process.stderr.read() if process.stderr else ""
        ready = json.loads(line)
        address = ready["http_address"]
        assert address.startswith("127.0.0.1:") and not address.endswith(":0")
        chat = openai.OpenAI(base_url=f"http://{address}/v1", api_key=DEV_KEY, max_retries=0)
        answer = chat.chat.completions.create(model="default", max_tokens=4,
                                              messages=[{"role": "user", "content": "hello from the cli"}])
        assert answer.choices[0].message.content and answer.usage.completion_tokens == 4
        message = anthropic.Anthropic(base_url=f"http://{address}", api_key=DEV_KEY, max_retries=0).messages.create(
            model="default", max_tokens=3, messages=[{"role": "user", "content": "hello from the cli"}])
        assert message.usage.output_tokens == 3
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    assert process.returncode == 0
    logged = (tmp_path / "run" / "requests.jsonl").read_text()
    assert logged.count('"status":"OK"') >= 2 or logged.count('"status": "OK"') >= 2
    assert DEV_KEY not in logged


def test_http_listen_off_loopback_is_refused_before_anything_starts(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "spine", "up", "--layout", "layered", "--listen", "127.0.0.1:0",
                          "--http-listen", "0.0.0.0:0", "--run-dir", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "not loopback" in run.stderr and not (tmp_path / "run").exists()
