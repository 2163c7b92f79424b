"""Where a model plugs into spine: the `ModelBackend` interface and the loader that picks one.

A backend is a tokenizer plus a `StepModel` (see `interface`), under an id. The embedded
`TinyLMBackend` is built from a seed; a user's own model comes in through a dotted path
(`{"class": "pkg.module:Factory", "options": {...}}`). A plain torch module that maps
ids [1, T] to logits [1, T, V] needs no cache code: wrap it in `ModuleStepModel`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from services.common import ConfigError
from services.inference.config import HF_CLASS, SIM_CLASS
from services.inference.model.engine import GenerationEngine
from services.inference.model.interface import (
    DeviceLike,
    ModelSizes,
    Segment,
    StepModel,
    TokenizedBackend,
    Tokenizer,
    torch_device,
)
from services.inference.model.tiny_lm import TinyLM
from services.inference.model.tokenizer import ByteTokenizer

TINY_LM_ID = "tiny-lm"
TINY_LM_MINI_ID = "tiny-lm-mini"
# The embedded models by id: TinyLM's dimensions. The mini is the default config's cheaper
# fallback: one layer of half the width, so a step costs less and a KV slot takes a quarter.
BUILT_IN: dict[str, dict[str, int]] = {
    TINY_LM_ID: {},
    TINY_LM_MINI_ID: {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64},
}


@runtime_checkable
class ModelBackend(Protocol):
    """A servable model: an id, a context limit, text <-> ids, and the engine-facing model."""

    @property
    def id(self) -> str: ...

    @property
    def max_context(self) -> int: ...

    @property
    def model(self) -> StepModel: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class TinyLMBackend(TokenizedBackend):
    """The embedded default: TinyLM weights from a seed and the byte tokenizer."""

    @classmethod
    def from_seed(
        cls, seed: int, *, model_id: str = TINY_LM_ID, device: DeviceLike | str | None = None, **dims: Any
    ) -> TinyLMBackend:
        model = TinyLM.from_seed(seed, **dims)
        if device is not None:
            model.to(torch_device(device))
        return cls(model_id, model, ByteTokenizer())


class ModuleStepModel(ModelSizes):
    """A StepModel for a torch module without a KV cache: ids [1, T] -> logits [1, T, V].

    Each step recomputes every sequence from its start, one sequence at a time: slow for
    long answers, but batch-invariant for any deterministic module.
    """

    def __init__(self, module: torch.nn.Module, vocab_size: int, max_context: int) -> None:
        self.module, self._vocab_size, self._max_context = module, vocab_size, max_context

    def to(self, device: torch.device) -> ModuleStepModel:
        self.module.to(device)
        return self

    def new_cache(self, slots: int, max_context: int, device: DeviceLike) -> list[list[int]]:
        return [[] for _ in range(slots)]

    def release_cache(self, cache: list[list[int]], device: DeviceLike) -> None:
        cache.clear()

    @torch.inference_mode()
    def step(self, segments: Sequence[Segment], cache: list[list[int]]) -> torch.Tensor:
        device = next(self.module.parameters(), torch.empty(0)).device
        rows = []
        for seg in segments:
            cache[seg.slot][seg.start :] = seg.token_ids
            ids = torch.tensor([cache[seg.slot]], dtype=torch.long, device=device)
            rows.append(self.module(ids)[0, -1].to(torch.float64))
        return torch.stack(rows)


def load_backend(
    spec: Mapping[str, Any], *, device: DeviceLike | str | None = None, where: str = "inference"
) -> ModelBackend:
    """The backend a config section names; errors name the field (`where`.key) and the value.

    `{"model_id": "tiny-lm", "seed": 1234}` builds the embedded model (optional
    `max_context`); `{"class": "pkg.module:Factory", "options": {...}}` calls
    `Factory(**options)`, which must return a ModelBackend; `{"class": "hf", "options":
    {"path": DIR}}` serves a transformers causal LM directory under `model_id` (transformers
    is imported only then); `{"class": "sim", "options": {...}}` the device-time simulator
    (`sim_backend`). Other keys belong to the caller (e.g. `max_batch`) and are
    ignored here.
    """
    if spec.get("class") == HF_CLASS:
        return _load_hf_backend(spec, device, where)
    if spec.get("class") == SIM_CLASS:
        return _load_sim_backend(spec, where)
    if "class" in spec:
        return _load_user_backend(spec, where)
    model_id = spec.get("model_id", TINY_LM_ID)
    if model_id not in BUILT_IN:
        raise ConfigError(
            f"{where}.model_id: unknown model {model_id!r}; built in: {', '.join(map(repr, BUILT_IN))} "
            f"(give {where}.class to load your own)"
        )
    seed = spec.get("seed", 1234)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"{where}.seed: expected an integer, got {seed!r}")
    dims: dict[str, int] = dict(BUILT_IN[model_id])
    if "max_context" in spec:
        value = spec["max_context"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 2:
            raise ConfigError(f"{where}.max_context: expected an integer >= 2, got {value!r}")
        dims["max_context"] = value
    try:
        return TinyLMBackend.from_seed(seed, model_id=model_id, device=device, **dims)
    except ValueError as err:
        raise ConfigError(f"{where}: {err}") from err


def make_engine(
    backend: ModelBackend, device: DeviceLike | str, max_slots: int, max_context: int | None = None,
    *, prefix_caching: bool = True, prefix_budget_bytes: int | None = None,
) -> GenerationEngine:
    """An engine for `backend` on `device` (a DeviceState charges the KV cache to its budget);
    `prefix_budget_bytes` bounds the shared prefixes a slot pool keeps (`kv_prefix`)."""
    return GenerationEngine(
        backend.model, backend.tokenizer, device, max_slots, max_context or backend.max_context,
        prefix_caching=prefix_caching, prefix_budget_bytes=prefix_budget_bytes,
    )


def _load_hf_backend(spec: Mapping[str, Any], device: DeviceLike | str | None, where: str) -> ModelBackend:
    options = spec.get("options") or {}
    if not isinstance(options, Mapping):
        raise ConfigError(f"{where}.backend.options: expected a mapping, got {type(options).__name__}")
    if "max_context" in spec and "max_context" not in options:
        options = {**options, "max_context": spec["max_context"]}
    from services.inference.model.hf_backend import load_hf_backend

    model_id = spec.get("model_id")
    return load_hf_backend(options, model_id=model_id if isinstance(model_id, str) else None, device=device,
                           where=f"{where}.backend")


def _load_sim_backend(spec: Mapping[str, Any], where: str) -> ModelBackend:
    from services.inference.model.sim_backend import load_sim_backend

    options = spec.get("options") or {}
    if "max_context" in spec and isinstance(options, Mapping) and "max_context" not in options:
        options = {**options, "max_context": spec["max_context"]}
    model_id = spec.get("model_id")
    return load_sim_backend(options, model_id=model_id if isinstance(model_id, str) else None,
                            where=f"{where}.backend")


def _load_user_backend(spec: Mapping[str, Any], where: str) -> ModelBackend:
    target = spec["class"]
    if not isinstance(target, str) or target.count(":") != 1:
        raise ConfigError(f"{where}.class: expected 'package.module:Factory', got {target!r}")
    module_name, attr = target.split(":")
    try:
        factory: Callable[..., Any] = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"{where}.class: cannot import {target!r}: {err}") from err
    options = spec.get("options") or {}
    if not isinstance(options, Mapping):
        raise ConfigError(f"{where}.options: expected a mapping, got {type(options).__name__}")
    backend = factory(**options)
    if not isinstance(backend, ModelBackend):
        raise ConfigError(
            f"{where}.class: {target} returned {type(backend).__name__}, which is not a ModelBackend "
            "(needs id, max_context, model, tokenizer, encode, decode)"
        )
    return backend
