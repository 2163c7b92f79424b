"""Request validation limits (the `limits` config section): what the gateway accepts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import Field, StrictInt

from services.config_model import Float, Section


class RequestLimits(Section):
    """The `limits` section. Checked by the gateway's validation stage, in every layout."""

    max_prompt_chars: Annotated[StrictInt, Field(ge=1)] = 2048
    max_tokens: Annotated[StrictInt, Field(ge=1)] = 256
    max_temperature: Annotated[Float, Field(ge=0)] = 2.0
    max_message_bytes: Annotated[StrictInt, Field(ge=1024)] = 1 << 20
    # A client that sends no deadline gets this one: nothing waits forever.
    default_deadline_s: Annotated[Float, Field(ge=0.001)] = 30.0

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> RequestLimits:
        """The `limits` section of a whole config mapping."""
        return cls.parse(config.get("limits"), "limits")
