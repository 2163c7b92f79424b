"""The SmolLM2 directory `spine model get` writes is read alike by transformers 4.x (the
project's) and 5.x (vLLM's): the same ids for the same text and chat, the same text back.

Its tokenizer is a GPT-2-style byte-level BPE; named `LlamaTokenizer` (what a GGUF conversion
writes), transformers 5 rebuilt a SentencePiece-style pipeline and an engine answered
"ĊĊTheĠanswerĠis" with its spaces and newlines lost. 5.x runs in vLLM's virtualenv (`make
engine`), as a child process; without it that half skips, saying so. A directory converted
before the fix is mended in place when `spine model get` reuses it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from spine.tools.engine import EngineUnavailable, engine_python  # noqa: E402
from spine.tools.model.get import BYTE_LEVEL_BPE, fix_tokenizer_config  # noqa: E402
from tests.vllm_server import model_dir  # noqa: E402

# The first test here may start vLLM for the session (`vllm_engine`): minutes on a loaded 2-core host.
pytestmark = pytest.mark.timeout(900)
TEXTS = ["Hello world.\nThe capital of France is", "  two spaces, tabs\tand ünïcödé: 日本語 ✓", "{\"city\": \"Paris\"}\n\n"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour.\nOne word."}]
# Run by both transformers: ids and decoded text for each text, and the chat template's ids.
PROBE = """
import json, sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
texts, chat = json.loads(sys.argv[2]), json.loads(sys.argv[3])
out = {"class": type(tok).__name__, "texts": []}
for text in texts:
    ids = tok(text)["input_ids"]
    out["texts"].append([ids, tok.decode(ids, skip_special_tokens=True), tok.convert_ids_to_tokens(ids)[:3]])
prompt = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
out["chat"] = [prompt, tok(prompt, add_special_tokens=False)["input_ids"]]
print(json.dumps(out))
"""


def read_with(python: str, directory: Path) -> dict[str, object]:
    run = subprocess.run([python, "-c", PROBE, str(directory), json.dumps(TEXTS), json.dumps(CHAT)],
                         capture_output=True, text=True, timeout=300, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return model_dir()


def test_the_directory_names_its_tokenizer_as_byte_level_bpe(smollm2: Path) -> None:
    config = json.loads((smollm2 / "tokenizer_config.json").read_text())
    assert {key: config.get(key) for key in BYTE_LEVEL_BPE} == BYTE_LEVEL_BPE
    ours = read_with(sys.executable, smollm2)
    texts = ours["texts"]
    assert isinstance(texts, list)
    for text, (_ids, decoded, _) in zip(TEXTS, texts, strict=True):
        assert decoded == text  # a byte-level BPE gives every byte back


def test_transformers_4_and_5_read_it_alike(smollm2: Path) -> None:
    try:
        engine = str(engine_python())
    except EngineUnavailable as why:
        pytest.skip(f"no transformers 5.x here: {why}")
    ours, vllms = read_with(sys.executable, smollm2), read_with(engine, smollm2)
    assert ours["texts"] == vllms["texts"]
    assert ours["chat"] == vllms["chat"]


def test_a_directory_written_before_the_fix_is_mended_when_reused(smollm2: Path, tmp_path: Path) -> None:
    old = tmp_path / "old"
    shutil.copytree(smollm2, old)
    config = json.loads((old / "tokenizer_config.json").read_text())
    config.update({"tokenizer_class": "LlamaTokenizer", "add_prefix_space": None, "clean_up_tokenization_spaces": True})
    (old / "tokenizer_config.json").write_text(json.dumps(config))
    assert fix_tokenizer_config(old) and not fix_tokenizer_config(old)  # mended once, then left alone
    mended = json.loads((old / "tokenizer_config.json").read_text())
    assert {key: mended.get(key) for key in BYTE_LEVEL_BPE} == BYTE_LEVEL_BPE
    assert mended["added_tokens_decoder"] == config["added_tokens_decoder"]  # the rest as it was

