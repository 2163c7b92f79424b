"""`spine model make-tiny` then `spine up --model DIR`, in both layouts, as a person would run them.

The issue's check: a Generate call for model `default` returns 8 tokens naming the served
model; both layouts give the same tokens; a directory that cannot be served stops
`spine up` with one line and exit 2 before anything starts.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

pytest.importorskip("transformers")

from tests.conftest import DEV_KEY  # noqa: E402
from wire.v1 import gateway_pb2_grpc, generation_pb2  # noqa: E402

ANSWERS: dict[str, list[int]] = {}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("models") / "tiny-llama"
    made = subprocess.run([sys.executable, "-m", "spine", "model", "make-tiny", "--arch", "llama", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    assert made.stdout.startswith(f"{out}: llama with 2 layers")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()}
    return out


@pytest.mark.parametrize("layout", ["collapsed", "layered"])
def test_spine_up_model_serves_the_directory_as_default_in_every_layout(
        tiny_llama: Path, tmp_path: Path, layout: str) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "spine", "up", "--layout", layout, "--listen", "127.0.0.1:0",
         "--http-listen", "127.0.0.1:0", "--run-dir", str(tmp_path / "run"), "--model", str(tiny_llama)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line, f"spine up exited: {process.stderr.read() if process.stderr else ''}"
        ready = json.loads(line)
        assert ready["layout"] == layout and ready["health"]["serving"] is True
        with grpc.insecure_channel(ready["address"]) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            answer = stub.Generate(
                generation_pb2.GenerateRequest(model="default", prompt="Hello, spine!", max_tokens=8),
                metadata=(("authorization", f"Bearer {DEV_KEY}"),), timeout=60)
            with pytest.raises(grpc.RpcError) as unknown:
                stub.Generate(generation_pb2.GenerateRequest(model="tiny-lm", prompt="Hello", max_tokens=8),
                              metadata=(("authorization", f"Bearer {DEV_KEY}"),), timeout=60)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    assert answer.model == "tiny-llama" and len(answer.token_ids) == 8 and answer.finish_reason == "length"
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    assert "known: tiny-llama (aliases: default)" in unknown.value.details()
    ANSWERS[layout] = list(answer.token_ids)
    if len(ANSWERS) == 2:
        assert ANSWERS["collapsed"] == ANSWERS["layered"]


def test_spine_up_model_refuses_a_missing_directory_in_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "no-model"
    run = subprocess.run([sys.executable, "-m", "spine", "up", "--layout", "layered", "--listen", "127.0.0.1:0",
                          "--http-listen", "127.0.0.1:0", "--run-dir", str(tmp_path / "run"), "--model", str(missing)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.splitlines() == [f"config error: inference.backend.options.path: {missing}: no such directory"]
    assert not (tmp_path / "run" / "config.yaml").exists()  # refused before anything started
