"""Serve a local transformers causal LM: `inference.backend: {class: hf, options: {path: DIR}}`.

The directory holds `config.json`, `*.safetensors` weights and the tokenizer's files
(`spine model make-tiny` writes one). Loading it, in this order:

1. `hf_check.inspect_model_dir` reads the config and the safetensors headers only: a
   missing or unreadable directory, an architecture that is not a causal LM, a context
   longer than the model allows or weights larger than the device budget are refused
   with one line before anything heavy is read;
2. the tokenizer and the model load from the directory alone (`local_files_only`, no
   remote code, hub access off), the model in its config's dtype (or `options.dtype`),
   on the device of the device context (CUDA when present, else the CPU);
3. `hf_step.HFStepModel` wraps the model for the engine, its KV cache in the engine's
   slot pool, sized from what the model caches per layer.

transformers is an optional dependency (`pip install spine[hf]`); nothing imports this
module until a config names `class: hf`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from services.common import ConfigError
from services.inference.model.chat import ChatMessage, check_messages, plain_parts
from services.inference.model.hf_check import ModelDir, check_context, check_weights_fit, inspect_model_dir
from services.inference.model.interface import DeviceLike, torch_device
from services.inference.model.pooling import hidden_size, mean_pooled
from services.pipeline.system_prompt import SEPARATOR

log = logging.getLogger("spine.inference")

OPTIONS = ("path", "max_context", "dtype", "batch_invariant", "attn_implementation")
DTYPES = ("auto", "float32", "bfloat16", "float16")


class HFTokenizer:
    """A transformers tokenizer as the engine's `Tokenizer`.

    `vocab_size` is the model's (its logits' width), which may exceed the tokenizer's
    own ids; the step model never picks those. The engine puts `bos_id` before every
    prompt: the tokenizer's BOS, or its EOS where it has none (as GPT-2 does). An answer
    ends (finish_reason "stop") at any of `stop_ids`: the tokenizer's EOS and the
    generation config's `eos_token_id`s (an instruct model's end of turn, `<|im_end|>`).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, extra_stop_ids: Sequence[int] = ()) -> None:
        self.hf = tokenizer
        self.vocab_size = vocab_size
        eos = tokenizer.eos_token_id
        bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos
        if eos is None or bos is None:
            raise ValueError("the tokenizer has no EOS token (needed to end answers)")
        self.bos_id, self.eos_id = int(bos), int(eos)
        if max(self.bos_id, self.eos_id) >= vocab_size:
            raise ValueError(f"the tokenizer's BOS/EOS ids ({self.bos_id}, {self.eos_id}) are past the model's "
                             f"vocabulary of {vocab_size}")
        self.stop_ids = frozenset({self.eos_id, *(int(i) for i in extra_stop_ids if 0 <= int(i) < vocab_size)})
        self._system_start = lru_cache(maxsize=64)(self._render_system_start)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.hf.decode([int(i) for i in ids], skip_special_tokens=True))

    def encode_chat(self, prompt: str, system: str | None = None) -> list[int]:
        """The prompt through the model's chat template (a system message first when given),
        ready for the assistant's answer; without a template, the plain prompt."""
        if not self.has_chat_template:
            return self.encode(prompt if not system else f"{system}{SEPARATOR}{prompt}")
        messages = [ChatMessage("user", prompt)]
        if system:
            messages.insert(0, ChatMessage("system", system))
        return self.encode_messages(messages)

    def chat_parts(self, prompt: str, system: str | None = None) -> tuple[list[int], list[int]]:
        """`encode_chat`'s ids as (shared prefix, rest): the prefix is the longest start of them
        that the system prompt alone decides, so every request with this system prompt starts
        with exactly those tokens and the engine may keep their KV once (`kv_prefix`)."""
        ids = self.encode_chat(prompt, system)
        if not system:
            return [], ids
        return _split(ids, self._system_start((system,)))

    def messages_parts(self, messages: Iterable[Mapping[str, Any] | ChatMessage]) -> tuple[list[int], list[int]]:
        """`encode_messages`'s ids as (shared prefix, rest), the prefix decided by the system
        messages alone (see `chat_parts`)."""
        checked = check_messages(messages)
        ids = self.encode_messages(checked)
        systems = tuple(m.content for m in checked if m.role == "system")
        return _split(ids, self._system_start(systems)) if systems else ([], ids)

    def _render_system_start(self, systems: tuple[str, ...]) -> tuple[int, ...]:
        """The tokens two conversations with these system messages and different user messages
        share: what the template renders before anything a user says. (Rendering the system
        message alone would not do: a template may refuse it, and a BPE may merge across
        the boundary.)"""
        renders = [self.encode_messages([*(ChatMessage("system", text) for text in systems), ChatMessage("user", user)])
                   for user in ("a", "b")]
        return tuple(renders[0][:_common_length(*renders)])

    def encode_messages(self, messages: Iterable[Mapping[str, Any] | ChatMessage]) -> list[int]:
        """A conversation (role: system | user | assistant, content) through the model's own chat
        template, ready for the assistant's turn, without the BOS the engine adds; without a
        template, read plainly (`services.inference.model.chat.plain_parts`). ValueError for a bad message."""
        checked = check_messages(messages)
        if not self.has_chat_template:
            system, prompt = plain_parts(checked)
            return self.encode(f"{system}{SEPARATOR}{prompt}" if system else prompt)
        rendered = [{"role": m.role, "content": m.content} for m in checked]
        ids = [int(i) for i in self.hf.apply_chat_template(rendered, add_generation_prompt=True, tokenize=True)]
        return ids[1:] if ids and ids[0] == self.bos_id else ids  # the engine adds BOS itself


@dataclass
class HFBackend:
    """A ModelBackend for a transformers causal LM directory."""

    id: str
    model: Any  # HFStepModel
    tokenizer: HFTokenizer
    info: ModelDir

    @property
    def max_context(self) -> int:
        return int(self.model.max_context)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def encode_chat(self, prompt: str, system: str | None = None) -> list[int]:
        return self.tokenizer.encode_chat(prompt, system)

    @property
    def has_chat_template(self) -> bool:
        return self.tokenizer.has_chat_template

    def encode_messages(self, messages: Iterable[Mapping[str, Any] | ChatMessage]) -> list[int]:
        """See `HFTokenizer.encode_messages`; `services.inference.model.chat.encode_messages` picks this or
        the plain form for any backend."""
        return self.tokenizer.encode_messages(messages)

    def encode_chat_parts(self, prompt: str, system: str | None = None) -> tuple[list[int], list[int]]:
        """(shared prefix, prompt) ids: see `HFTokenizer.chat_parts`."""
        return self.tokenizer.chat_parts(prompt, system)

    def encode_messages_parts(self, messages: Iterable[Mapping[str, Any] | ChatMessage]) -> tuple[list[int], list[int]]:
        """(shared prefix, prompt) ids of a conversation: see `HFTokenizer.messages_parts`."""
        return self.tokenizer.messages_parts(messages)

    @property
    def embedding_size(self) -> int:
        return hidden_size(self.model.module)

    def embed(self, ids: Sequence[int]) -> list[float]:
        """The model's pooled embedding of `ids` (`services.inference.model.pooling`): what
        `POST /v1/embeddings` answers with from this backend."""
        return mean_pooled(self.model.module, ids, self.tokenizer.bos_id)


def _common_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _split(ids: list[int], start: Sequence[int]) -> tuple[list[int], list[int]]:
    """`ids` cut after the longest start they share with `start`."""
    n = _common_length(ids, start)
    return ids[:n], ids[n:]


def load_hf_backend(options: Mapping[str, Any], *, model_id: str | None = None, device: DeviceLike | str | None = None,
                    where: str = "inference.backend") -> HFBackend:
    """The backend for `options` (`path`, optional `max_context`, `dtype`, `batch_invariant`,
    `attn_implementation`); ConfigError (one line naming the field) when it cannot be served."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"{where}.options: unknown option(s) {', '.join(unknown)}; known: {', '.join(OPTIONS)}")
    path = options.get("path")
    if not isinstance(path, str | os.PathLike) or not str(path):
        raise ConfigError(f"{where}.options.path: the model directory is required (class: hf)")
    dtype = options.get("dtype", "auto")
    if dtype not in DTYPES:
        raise ConfigError(f"{where}.options.dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    invariant = options.get("batch_invariant")
    if invariant is not None and not isinstance(invariant, bool):
        raise ConfigError(f"{where}.options.batch_invariant: expected true, false or null, got {invariant!r}")
    info = inspect_model_dir(path, f"{where}.options.path", dtype)
    max_context = check_context(info, options.get("max_context"), f"{where}.options.max_context")
    _check_budget(info, device)
    tokenizer, module = _load(info, dtype, options.get("attn_implementation"), device, where)
    from services.inference.model.hf_step import HFStepModel

    try:
        step_model = HFStepModel(module, tokenizer_size=len(tokenizer), max_context=max_context,
                                 batch_invariant=invariant)
    except (ValueError, RuntimeError, TypeError) as error:
        raise ConfigError(f"{where}.options.path: {info.path}: {info.architecture} cannot run as a step "
                          f"model: {_first_line(error)}") from None
    try:
        hf_tokenizer = HFTokenizer(tokenizer, step_model.vocab_size, _generation_stop_ids(module))
    except ValueError as error:
        raise ConfigError(f"{where}.options.path: {info.path}: {error}") from None
    served = model_id or info.path.name
    log.info("inference %s: %s from %s on %s, %s, %.1f MiB of weights, context %d (model allows %d, %s), "
             "%d cached layers", served, info.architecture, info.path, step_model.device, step_model.kv_dtype,
             info.weight_bytes / (1 << 20), max_context, info.context, info.context_key, len(step_model.layers))
    return HFBackend(served, step_model, hf_tokenizer, info)


def _generation_stop_ids(module: Any) -> list[int]:
    """The generation config's `eos_token_id` (one id or several), where the model has one."""
    ids = getattr(getattr(module, "generation_config", None), "eos_token_id", None)
    if ids is None:
        return []
    return [int(i) for i in (ids if isinstance(ids, list | tuple) else [ids])]


def _check_budget(info: ModelDir, device: DeviceLike | str | None) -> None:
    budget = getattr(device, "budget_bytes", None)
    usage = getattr(device, "usage", None)
    if isinstance(budget, int) and callable(usage):
        check_weights_fit(info, max(0, budget - sum(usage().values())), budget)


def _load(info: ModelDir, dtype: str, attn: Any, device: DeviceLike | str | None, where: str) -> tuple[Any, Any]:
    """The tokenizer and the model, from the directory alone, the model on `device`."""
    # Nothing at run time may reach a hub: set before huggingface_hub reads its settings.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    target = torch_device(device) if device is not None else torch.device("cpu")
    try:
        tokenizer = AutoTokenizer.from_pretrained(info.path, local_files_only=True, trust_remote_code=False)
    except Exception as error:
        raise ConfigError(f"{where}.options.path: {info.path}: cannot load the tokenizer: "
                          f"{_first_line(error)}") from None
    kwargs: dict[str, Any] = {"local_files_only": True, "trust_remote_code": False, "use_safetensors": True,
                              "dtype": dtype}
    if attn is not None:
        kwargs["attn_implementation"] = str(attn)
    try:
        module: Any = AutoModelForCausalLM.from_pretrained(info.path, **kwargs)
    except Exception as error:
        raise ConfigError(f"{where}.options.path: {info.path}: cannot load the model: {_first_line(error)}") from None
    return tokenizer, module.to(target).eval()


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]
