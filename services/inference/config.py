"""The `inference:` config section: the model, its KV pool, the queue and the serving controls.

Every key is documented in runtime/default_config.yaml. A light module (no torch), so that the
root config model can include it without loading the model's code.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import (
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    model_validator,
)

from services.common.config_section import AutoOrCount, Float, Items, NonEmptyStr, Section, problem
from services.common.prometheus_http import ListenAddress
from services.pipeline.limits import DEFAULT_MAX_INFERENCE_TIMEOUT_MS

# `inference.backend.class: hf`: a local transformers causal LM directory
# (services.inference.model.hf_backend). Here, not beside the backends, so that a process that only
# checks a config (the layered gateway's preflight) does not import torch with them.
HF_CLASS = "hf"
# `inference.backend.class: sim`: no weights, each step a device's time off the CPU
# (services.inference.model.sim_backend: the cost model and its default profile).
SIM_CLASS = "sim"

Count = Annotated[StrictInt, Field(ge=1)]


class BackendSpec(Section):
    """`inference.backend`: another model than the built-in one, or the built-in one resized.

    `services.inference.model.backend.load_backend` reads these keys (and checks what only an import
    can tell, such as whether `class` exists); the model refuses any other key."""

    class_: Annotated[str | None, Field(alias="class", pattern=r"^(hf|sim|[^:]+:[^:]+)$",
                                        description="'hf' (a local transformers causal LM: options.path), 'sim' "
                                                    "(a device-time simulator: options.profile and its figures) "
                                                    "or 'package.module:Factory' returning a ModelBackend")] = None
    options: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for `class` "
                                    "(hf: path, max_context, dtype, batch_invariant, attn_implementation; sim: profile, "
                                    "prefill_ms_per_token, decode_base_ms, decode_ms_per_seq, kv_budget_tokens, "
                                    "kv_bytes_per_token, max_context)")
    model_id: NonEmptyStr | None = None
    seed: StrictInt | None = None
    max_context: Annotated[StrictInt, Field(ge=2)] | None = None

    def spec(self) -> dict[str, Any]:
        """The keys given, as `load_backend` reads them."""
        return self.model_dump(by_alias=True, exclude_none=True, exclude_defaults=True)


class InferenceConfig(Section):
    """The `inference` section."""

    where = "inference"

    model_id: NonEmptyStr = "tiny-lm"
    seed: StrictInt = 1234
    max_batch: Count = 16
    max_queue: Count = 256
    backend: BackendSpec = BackendSpec()
    kv_cache_max_entries: AutoOrCount = "auto"  # 'auto': sized from free memory at start
    kv_memory_fraction: Annotated[Float, Field(ge=0.01, le=1)] = 0.5
    kv_cpu_memory_cap_mb: Annotated[Float, Field(ge=1)] = 1024.0
    aging_ms: Annotated[Float, Field(ge=1)] = 500.0
    # Slots kept for tenants running fewer than their share (services.inference.scheduler).
    share_headroom_slots: Annotated[StrictInt, Field(ge=0)] = 1
    max_timeout_ms: Count = DEFAULT_MAX_INFERENCE_TIMEOUT_MS
    timeout_margin_ms: Annotated[Float, Field(ge=0)] = 5_000.0
    timeout_slowdown: Annotated[Float, Field(ge=1)] = 4.0
    warmup_tokens: Count = 8
    stream_idle_timeout_s: Annotated[Float, Field(gt=0)] = 10.0
    stream_buffer_max_bytes: Annotated[StrictInt, Field(ge=1024)] = 1 << 20
    deterministic: StrictBool = False
    health_interval_s: Annotated[Float, Field(ge=0.01)] = 1.0
    health_timeout_s: Annotated[Float, Field(ge=0.01)] = 2.0
    prefix_cache: StrictBool = True  # keep a shared system prompt's KV once (paged pools; slot pools: a stored copy)
    metrics_listen: ListenAddress = "127.0.0.1:0"  # its own /metrics where the metrics component is elsewhere
    # More models served beside this one, each with its own weights, KV pool, scheduler and
    # load hint (`services.inference.models`). A block names its `model_id` and may set any
    # key above; the serving controls it leaves out are this section's, but never the model
    # itself (`backend` and `seed` are the block's own, default the embedded model). Left out,
    # the section serves `DEFAULT_MODEL_BLOCKS` beside its own model.
    models: Items[InferenceConfig] = ()

    @model_validator(mode="before")
    @classmethod
    def _models_inherit_serving_controls(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        if "models" not in data:
            data = {**data, "models": list(DEFAULT_MODEL_BLOCKS)}
        blocks = data["models"]
        if not isinstance(blocks, list | tuple) or not blocks:
            return data
        # A block serves no further models unless it says so (and is then refused).
        own = [{"models": (), **block} if isinstance(block, Mapping) else block for block in blocks]
        try:  # a bad key of the section is reported once, there, not again under every model
            InferenceConfig.model_validate({**data, "models": ()})
        except ValidationError:
            return {**data, "models": own}
        inherited = {key: value for key, value in data.items() if key not in _OWN_KEYS}
        return {**data, "models": [{**inherited, **block} if isinstance(block, Mapping) else block for block in own]}

    @model_validator(mode="after")
    def _model_ids_are_unique(self) -> InferenceConfig:
        seen = {self.model_id: "model_id"}
        for i, model in enumerate(self.models):
            if model.models:
                raise problem("a served model cannot serve more models", "models", i, "models")
            if model.model_id in seen:
                raise problem(f"{model.model_id!r} is already served (inference.{seen[model.model_id]})",
                              "models", i, "model_id")
            seen[model.model_id] = f"models[{i}].model_id"
        return self

    def served(self) -> tuple[InferenceConfig, ...]:
        """This model's section and every other model's, in order."""
        return (self, *self.models)

    @property
    def kv_slots(self) -> int | None:
        """The KV pool size asked for; None for `auto`."""
        return None if self.kv_cache_max_entries == "auto" else int(self.kv_cache_max_entries)


# What a model block of `inference.models` never inherits from the section: which model it is.
_OWN_KEYS = frozenset({"model_id", "backend", "seed", "models"})
# The models a section serves beside its own when it names none: one layer of half the
# width, cheaper steps and a quarter of the KV per slot (the built-in model's fallback).
DEFAULT_MODEL_BLOCKS: tuple[Mapping[str, Any], ...] = ({"model_id": "tiny-lm-mini", "max_batch": 8},)
