"""The `inference:` config section: the model, its KV pool, the queue and the serving controls.

Every key is documented in spine/default_config.yaml. Errors name the field and value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from services.common import ConfigError, number

_KNOWN = {
    "model_id", "seed", "max_batch", "max_queue", "backend", "kv_cache_max_entries", "kv_memory_fraction",
    "kv_cpu_memory_cap_mb", "aging_ms", "max_timeout_ms", "timeout_margin_ms", "timeout_slowdown",
    "warmup_tokens", "stream_buffer_chunks", "deterministic", "health_interval_s", "health_timeout_s",
}


@dataclass(frozen=True)
class InferenceConfig:
    model_id: str = "tiny-lm"
    seed: int = 1234
    max_batch: int = 16
    max_queue: int = 256
    backend: Mapping[str, Any] = field(default_factory=dict)
    kv_cache_max_entries: int | None = None  # None = auto (sized from free memory)
    kv_memory_fraction: float = 0.5
    kv_cpu_memory_cap_mb: float = 1024.0
    aging_ms: float = 500.0
    max_timeout_ms: int = 120_000
    timeout_margin_ms: float = 5_000.0
    timeout_slowdown: float = 4.0
    warmup_tokens: int = 8
    stream_buffer_chunks: int = 64
    deterministic: bool = False
    health_interval_s: float = 1.0
    health_timeout_s: float = 2.0

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> InferenceConfig:
        unknown = sorted(set(cfg) - _KNOWN)
        if unknown:
            raise ConfigError(f"inference: unknown key(s) {unknown}; known: {sorted(_KNOWN)}")
        model_id = cfg.get("model_id", cls.model_id)
        if not isinstance(model_id, str) or not model_id:
            raise ConfigError(f"inference.model_id: expected a non-empty string, got {model_id!r}")
        seed = cfg.get("seed", cls.seed)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"inference.seed: expected an integer, got {seed!r}")
        backend = cfg.get("backend") or {}
        if not isinstance(backend, Mapping):
            raise ConfigError("inference.backend: expected a mapping")
        deterministic = cfg.get("deterministic", False)
        if not isinstance(deterministic, bool):
            raise ConfigError(f"inference.deterministic: expected true or false, got {deterministic!r}")
        fraction = number(cfg, "kv_memory_fraction", cls.kv_memory_fraction, where="inference", minimum=0.01)
        if fraction > 1:
            raise ConfigError(f"inference.kv_memory_fraction: must be <= 1, got {fraction!r}")

        def whole(key: str, default: float, minimum: float = 1) -> int:
            value = number(cfg, key, default, where="inference", minimum=minimum)
            if value != int(value):
                raise ConfigError(f"inference.{key}: expected a whole number, got {value!r}")
            return int(value)

        def real(key: str, default: float, minimum: float = 0.0) -> float:
            return number(cfg, key, default, where="inference", minimum=minimum)

        return cls(
            model_id=model_id, seed=seed, backend=backend, deterministic=deterministic,
            max_batch=whole("max_batch", cls.max_batch),
            max_queue=whole("max_queue", cls.max_queue),
            kv_cache_max_entries=_slots(cfg.get("kv_cache_max_entries", "auto")),
            kv_memory_fraction=fraction,
            kv_cpu_memory_cap_mb=real("kv_cpu_memory_cap_mb", cls.kv_cpu_memory_cap_mb, minimum=1),
            aging_ms=real("aging_ms", cls.aging_ms, minimum=1),
            max_timeout_ms=whole("max_timeout_ms", cls.max_timeout_ms),
            timeout_margin_ms=real("timeout_margin_ms", cls.timeout_margin_ms),
            timeout_slowdown=real("timeout_slowdown", cls.timeout_slowdown, minimum=1),
            warmup_tokens=whole("warmup_tokens", cls.warmup_tokens),
            stream_buffer_chunks=whole("stream_buffer_chunks", cls.stream_buffer_chunks),
            health_interval_s=real("health_interval_s", cls.health_interval_s, minimum=0.01),
            health_timeout_s=real("health_timeout_s", cls.health_timeout_s, minimum=0.01),
        )


def _slots(value: Any) -> int | None:
    if value == "auto" or value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"inference.kv_cache_max_entries: expected 'auto' or an integer >= 1, got {value!r}")
    return value
