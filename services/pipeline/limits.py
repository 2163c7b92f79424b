"""Request validation limits (the `limits` config section, plus the model's timeout cap)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.common import ConfigError, number, section
from services.inference_config import InferenceConfig

# Read from `inference.max_timeout_ms`, not from `limits`: one key, so the gateway's check
# (before the cache) and the model's own can never disagree.
DERIVED = ("max_inference_timeout_ms",)


@dataclass(frozen=True)
class RequestLimits:
    max_prompt_chars: int = 2048
    max_tokens: int = 256
    max_temperature: float = 2.0
    max_message_bytes: int = 1 << 20
    default_deadline_s: float = 30.0
    max_inference_timeout_ms: int = InferenceConfig.model_fields["max_timeout_ms"].default

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> RequestLimits:
        cfg = section(config, "limits")
        unknown = sorted(set(cfg) - (set(cls.__dataclass_fields__) - set(DERIVED)))
        if unknown:
            raise ConfigError(f"limits: unknown key(s) {unknown}")
        return cls(
            max_prompt_chars=int(number(cfg, "max_prompt_chars", cls.max_prompt_chars, where="limits", minimum=1)),
            max_tokens=int(number(cfg, "max_tokens", cls.max_tokens, where="limits", minimum=1)),
            max_temperature=number(cfg, "max_temperature", cls.max_temperature, where="limits"),
            max_message_bytes=int(number(cfg, "max_message_bytes", cls.max_message_bytes, where="limits",
                                         minimum=1024)),
            default_deadline_s=number(cfg, "default_deadline_s", cls.default_deadline_s, where="limits",
                                      minimum=0.001),
            max_inference_timeout_ms=InferenceConfig.from_dict(section(config, "inference")).max_timeout_ms,
        )
