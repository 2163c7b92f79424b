"""What a model directory holds, checked before any weight is read.

`inspect_model_dir` reads only `config.json` and the safetensors headers, so a directory
that cannot be served — missing, unreadable, not a causal LM, without safetensors weights —
is refused in a fraction of a second with one line, and the size of its weights is known
before they are loaded (`check_weights_fit`: the device budget must hold them).
`check_context` refuses a context the model was not built for.

Every error is a `ConfigError` whose message starts with the config field it is about.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common import ConfigError
from services.common.json_object import json_object

# Where configs keep the longest sequence a model was built for, in the order we trust them.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")
SAFETENSORS_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                          "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}
FLOAT_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}
_FLOATS = {"F64", "F32", "F16", "BF16"}


@dataclass(frozen=True)
class ModelDir:
    """A servable directory: its config, architecture, context limit and weight size."""

    path: Path
    config: dict[str, Any]
    model_type: str
    architecture: str
    context: int          # the longest sequence the model allows
    context_key: str      # the config key that says so
    dtype: str | None     # from the config (None: the weights' own)
    weight_bytes: int     # at the dtype they will be loaded in
    weight_files: tuple[str, ...]


def inspect_model_dir(path: str | os.PathLike[str], where: str = "inference.backend.options.path",
                      dtype: str | None = None) -> ModelDir:
    """The directory's facts; ConfigError (one line, naming `where`) when it cannot be served."""
    root = Path(path).expanduser()
    if not root.exists():
        raise ConfigError(f"{where}: {root}: no such directory")
    if not root.is_dir():
        raise ConfigError(f"{where}: {root}: not a directory (give the model's directory)")
    if not os.access(root, os.R_OK | os.X_OK):
        raise ConfigError(f"{where}: {root}: cannot read the directory (permission denied)")
    config = _read_config(root, where)
    model_type = str(config.get("model_type") or "")
    architecture = _causal_architecture(root, config, model_type, where)
    context, key = model_context(config)
    if context is None:
        raise ConfigError(f"{where}: {root}/config.json says no context length (none of {', '.join(CONTEXT_KEYS)}); "
                          "give inference.backend.options.max_context")
    files = sorted(p for p in root.glob("*.safetensors") if p.is_file())
    if not files:
        other = sorted(p.name for p in root.glob("*.bin")) + sorted(p.name for p in root.glob("*.pt*"))
        hint = f" (found {', '.join(other[:3])}: convert them to safetensors)" if other else ""
        raise ConfigError(f"{where}: {root}: no *.safetensors weights{hint}")
    load_dtype = dtype if dtype not in (None, "auto") else _config_dtype(config)
    total = sum(_weight_bytes(file, load_dtype, where) for file in files)
    return ModelDir(path=root.resolve(), config=config, model_type=model_type, architecture=architecture,
                    context=context, context_key=key, dtype=load_dtype, weight_bytes=total,
                    weight_files=tuple(p.name for p in files))


def model_context(config: dict[str, Any]) -> tuple[int | None, str]:
    """The model's context limit and the key that gives it; a sliding window caps it (within the
    window, sliding attention equals full attention, which is what the backend computes)."""
    sources = [config, config.get("text_config") or {}]
    context, key = None, ""
    for source in sources:
        for name in CONTEXT_KEYS:
            value = source.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                context, key = value, name
                break
        if context is not None:
            break
    window = config.get("sliding_window")
    sliding = config.get("use_sliding_window", True) is not False or "sliding_attention" in (
        config.get("layer_types") or ())
    if isinstance(window, int) and window > 0 and sliding and (context is None or window < context):
        context, key = window, "sliding_window"
    return context, key


def kv_bytes_per_token(info: ModelDir) -> int | None:
    """What the KV cache holds per token, from config.json alone (layers × KV heads × head size ×
    2 for keys and values × the dtype's size); None when the config does not say. An estimate
    for sizing memory before the model loads: the engine's pool uses the shapes it measures."""
    config = {**(info.config.get("text_config") or {}), **info.config}
    layers = _first_int(config, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first_int(config, "num_attention_heads", "n_head")
    kv_heads = _first_int(config, "num_key_value_heads") or heads
    head_dim = _first_int(config, "head_dim")
    hidden = _first_int(config, "hidden_size", "n_embd")
    if head_dim is None and hidden and heads:
        head_dim = hidden // heads
    if not (layers and kv_heads and head_dim):
        return None
    return 2 * layers * kv_heads * head_dim * FLOAT_BYTES.get(info.dtype or "float32", 4)


def _first_int(config: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def check_context(info: ModelDir, requested: int | None, where: str = "inference.backend.options.max_context",
                  default_cap: int = 4096) -> int:
    """The context to serve: `requested`, or the model's own capped at `default_cap`."""
    if requested is None:
        return min(info.context, default_cap)
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 2:
        raise ConfigError(f"{where}: expected an integer >= 2, got {requested!r}")
    if requested > info.context:
        raise ConfigError(f"{where}: {requested} is longer than the model allows: {info.context} "
                          f"({info.context_key} in {info.path}/config.json)")
    return requested


def check_weights_fit(info: ModelDir, budget_left: int, budget_total: int,
                      where: str = "device.memory_budget_mib") -> None:
    """Refuse weights the device budget cannot hold (they would leave no room for the KV pool)."""
    if info.weight_bytes > budget_left:
        raise ConfigError(
            f"{where}: the weights of {info.path.name} ({_mib(info.weight_bytes)}, {info.dtype or 'as stored'}) "
            f"do not fit the device budget: {_mib(budget_left)} left of {_mib(budget_total)}; "
            "raise device.memory_budget_mib or serve a smaller model")


def _read_config(root: Path, where: str) -> dict[str, Any]:
    file = root / "config.json"
    try:
        text = file.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{where}: {root}: no config.json (not a transformers model directory)") from None
    except OSError as error:
        raise ConfigError(f"{where}: {file}: cannot read: {error.strerror}") from None
    return json_object(text, f"{where}: {file}", ConfigError)


def _causal_architecture(root: Path, config: dict[str, Any], model_type: str, where: str) -> str:
    """The config's causal-LM architecture; a ConfigError for anything else (an encoder, a
    classifier, an encoder-decoder) or for a model type this transformers does not know."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError as error:
        raise ConfigError(f"inference.backend.class: hf needs transformers (pip install 'spine[hf]'): "
                          f"{error}") from None
    causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    names = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    shown = ", ".join(names) or "none given"
    if config.get("is_encoder_decoder"):
        raise ConfigError(f"{where}: {root}: {shown} (model_type {model_type!r}) is an encoder-decoder, "
                          "not a causal LM")
    if model_type not in causal:
        raise ConfigError(f"{where}: {root}: model_type {model_type!r} ({shown}) is not a causal LM that "
                          f"transformers can load (causal LMs include llama, gpt2, mistral, qwen2, ...)")
    if not names:
        return causal[model_type]
    accepted = set(causal.values())
    for name in names:
        if name in accepted or name.endswith("ForCausalLM") or name.endswith("LMHeadModel"):
            return name
    raise ConfigError(f"{where}: {root}: architecture {shown} is not a causal LM (for {model_type!r} that is "
                      f"{causal[model_type]})")


def _config_dtype(config: dict[str, Any]) -> str | None:
    value = config.get("dtype") or config.get("torch_dtype")
    return value if isinstance(value, str) and value in FLOAT_BYTES else None


def _weight_bytes(file: Path, dtype: str | None, where: str) -> int:
    """Bytes of a safetensors file's tensors once loaded (floats converted to `dtype`), from its header."""
    try:
        with file.open("rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            if size > 100 << 20:
                raise ValueError(f"header of {size} bytes")
            header = json.loads(handle.read(size))
    except OSError as error:
        raise ConfigError(f"{where}: {file}: cannot read: {error.strerror}") from None
    except (struct.error, ValueError) as error:
        raise ConfigError(f"{where}: {file}: not a safetensors file ({error})") from None
    total = 0
    for name, entry in header.items():
        if name == "__metadata__" or not isinstance(entry, dict):
            continue
        count = 1
        for dim in entry.get("shape", []):
            count *= int(dim)
        kind = str(entry.get("dtype"))
        item = FLOAT_BYTES[dtype] if dtype and kind in _FLOATS else SAFETENSORS_ITEM_BYTES.get(kind, 4)
        total += count * item
    return total


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"
