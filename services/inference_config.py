"""The `inference:` config section: the model, its KV pool, the queue and the serving controls.

Every key is documented in spine/default_config.yaml. A light module (no torch), so that the
root config model can include it without loading the model's code.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import Field, StrictBool, StrictInt, StrictStr, field_validator

from services.config_model import AutoOrCount, Float, NonEmptyStr, Section, problem
from services.prometheus_http import parse_listen

Count = Annotated[StrictInt, Field(ge=1)]


class BackendSpec(Section):
    """`inference.backend`: another model than the built-in one, or the built-in one resized.

    `services.model.backend.load_backend` reads these keys (and checks what only an import
    can tell, such as whether `class` exists); the model refuses any other key."""

    class_: Annotated[str | None, Field(alias="class", pattern=r"^(hf|[^:]+:[^:]+)$",
                                        description="'hf' (a local transformers causal LM: options.path) or "
                                                    "'package.module:Factory' returning a ModelBackend")] = None
    options: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for `class` "
                                    "(hf: path, max_context, dtype, batch_invariant, attn_implementation)")
    model_id: NonEmptyStr | None = None
    seed: StrictInt | None = None
    max_context: Annotated[StrictInt, Field(ge=2)] | None = None

    def spec(self) -> dict[str, Any]:
        """The keys given, as `load_backend` reads them."""
        return self.model_dump(by_alias=True, exclude_none=True, exclude_defaults=True)


class InferenceConfig(Section):
    """The `inference` section."""

    model_id: NonEmptyStr = "tiny-lm"
    seed: StrictInt = 1234
    max_batch: Count = 16
    max_queue: Count = 256
    backend: BackendSpec = BackendSpec()
    kv_cache_max_entries: AutoOrCount = "auto"  # 'auto': sized from free memory at start
    kv_memory_fraction: Annotated[Float, Field(ge=0.01, le=1)] = 0.5
    kv_cpu_memory_cap_mb: Annotated[Float, Field(ge=1)] = 1024.0
    aging_ms: Annotated[Float, Field(ge=1)] = 500.0
    max_timeout_ms: Count = 120_000
    timeout_margin_ms: Annotated[Float, Field(ge=0)] = 5_000.0
    timeout_slowdown: Annotated[Float, Field(ge=1)] = 4.0
    warmup_tokens: Count = 8
    stream_idle_timeout_s: Annotated[Float, Field(gt=0)] = 10.0
    stream_buffer_max_bytes: Annotated[StrictInt, Field(ge=1024)] = 1 << 20
    deterministic: StrictBool = False
    health_interval_s: Annotated[Float, Field(ge=0.01)] = 1.0
    health_timeout_s: Annotated[Float, Field(ge=0.01)] = 2.0
    prefix_cache: StrictBool = True  # keep a shared system prompt's KV once (paged caches)
    metrics_listen: StrictStr = "127.0.0.1:0"  # its own /metrics where the metrics component is elsewhere

    @field_validator("metrics_listen")
    @classmethod
    def _listen_parses(cls, listen: str) -> str:
        try:
            parse_listen(listen)
        except ValueError as exc:
            raise problem(str(exc)) from None
        return listen

    @property
    def kv_slots(self) -> int | None:
        """The KV pool size asked for; None for `auto`."""
        return None if self.kv_cache_max_entries == "auto" else int(self.kv_cache_max_entries)

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any] | None) -> InferenceConfig:
        return cls.parse(cfg, "inference")
