"""Request validation at the front: the same checks, messages and codes in every layout."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.common import ConfigError, number, section
from spine.v1 import generation_pb2

PRIORITIES = (-1, 0, 1)


@dataclass(frozen=True)
class RequestLimits:
    max_prompt_chars: int = 2048
    max_tokens: int = 256
    max_temperature: float = 2.0
    max_message_bytes: int = 1 << 20
    default_deadline_s: float = 30.0

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> RequestLimits:
        cfg = section(config, "limits")
        unknown = sorted(set(cfg) - set(cls.__dataclass_fields__))
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
        )


def validation_error(request: generation_pb2.GenerateRequest, limits: RequestLimits) -> str | None:
    """The first problem with a request, as a message naming the field; None when valid."""
    if not request.model:
        return "model: required (e.g. 'tiny-lm')"
    if not request.prompt:
        return "prompt: must not be empty"
    if len(request.prompt) > limits.max_prompt_chars:
        return f"prompt: {len(request.prompt)} characters is over the limit of {limits.max_prompt_chars}"
    if request.max_tokens <= 0:
        return f"max_tokens: must be > 0, got {request.max_tokens}"
    if request.max_tokens > limits.max_tokens:
        return f"max_tokens: {request.max_tokens} is over the limit of {limits.max_tokens}"
    if not math.isfinite(request.temperature) or not 0.0 <= request.temperature <= limits.max_temperature:
        return f"temperature: must be between 0 and {limits.max_temperature}, got {request.temperature}"
    if request.priority not in PRIORITIES:
        return f"priority: must be one of {PRIORITIES}, got {request.priority}"
    if request.inference_timeout_ms < 0:
        return f"inference_timeout_ms: must be >= 0, got {request.inference_timeout_ms}"
    return None
