"""`spine up --layout bare`: the model alone over HTTP and gRPC, with an optional API key.

One real process for the module; the official SDKs and a gRPC stub as clients."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.bare_server import BARE_KEY, BareUpstream, bare_upstream
from wire.v1 import generation_pb2, inference_pb2_grpc


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BareUpstream]:
    with bare_upstream(tmp_path_factory.mktemp("bare")) as server:
        yield server


def chat(bare: BareUpstream, key: str = BARE_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=bare.base_url, api_key=key, max_retries=0)


def test_chat_plain_and_streamed_through_the_openai_sdk(bare: BareUpstream) -> None:
    client = chat(bare)
    raw = client.chat.completions.with_raw_response.create(
        model="default", max_tokens=6, temperature=0, messages=[{"role": "user", "content": "Hello"}])
    answer = raw.parse()
    assert raw.headers["x-spine-layout"] == "bare"
    assert answer.model == "tiny-lm" and answer.usage is not None and answer.usage.completion_tokens == 6
    streamed = client.chat.completions.create(
        model="default", max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Hello"}])
    pieces = [c.choices[0].delta.content or "" for c in streamed if c.choices]
    assert "".join(pieces) == answer.choices[0].message.content  # greedy: the same text either way


def test_text_completion_and_anthropic_messages(bare: BareUpstream) -> None:
    text = chat(bare).completions.create(model="mini", prompt="abc", max_tokens=3, temperature=0)
    assert text.model == "tiny-lm-mini" and text.usage is not None and text.usage.completion_tokens == 3
    claude = anthropic.Anthropic(base_url=f"http://{bare.http_address}", api_key=BARE_KEY, max_retries=0)
    message = claude.messages.create(model="default", max_tokens=4, messages=[{"role": "user", "content": "Hi"}],
                                     extra_body={"temperature": 0})  # greedy (this SDK takes no temperature)
    assert message.usage.output_tokens == 4 and message.content[0].type == "text"


def test_a_wrong_or_missing_key_is_refused(bare: BareUpstream) -> None:
    with pytest.raises(openai.AuthenticationError):
        chat(bare, key="not-the-key").chat.completions.create(
            model="default", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(openai.NotFoundError, match="unknown model"):
        chat(bare).chat.completions.create(model="no-such-model", max_tokens=2,
                                           messages=[{"role": "user", "content": "Hi"}])


def test_grpc_inference_wants_the_key_and_health_does_not(bare: BareUpstream) -> None:
    with grpc.insecure_channel(bare.address) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = generation_pb2.GenerateRequest(model="tiny-lm", prompt="abc", max_tokens=3)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Generate(request, timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        answer = stub.Generate(request, timeout=10, metadata=(("authorization", f"Bearer {BARE_KEY}"),))
        assert answer.completion_tokens == 3


def test_bare_refuses_what_it_cannot_do(tmp_path: Path) -> None:
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "spine", "up", "--layout", "bare", "--listen", "127.0.0.1:0",
                          "--http-listen", "off", "--inject-fault", "wrong-answers", "--run-dir", str(tmp_path / "r")],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "not with --layout bare" in run.stderr
