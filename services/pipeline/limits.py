"""Request validation limits (the `limits` config section, plus the model's timeout cap)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import Field, PrivateAttr, StrictInt

from services.common import section
from services.common.config_section import Float, Section

# The default of `inference.max_timeout_ms` (the inference section takes it from here: the
# gateway's check and the model's own read one key and one default).
DEFAULT_MAX_INFERENCE_TIMEOUT_MS = 120_000
# A gRPC call sent without a deadline reports a time remaining far in the future (its
# deadline is "infinite"): past this many seconds, the caller set none.
NO_DEADLINE_S = 1e6


class RequestLimits(Section):
    """The `limits` section. Checked by the gateway's validation stage, in every layout."""

    max_prompt_chars: Annotated[StrictInt, Field(ge=1)] = 2048
    max_system_chars: Annotated[StrictInt, Field(ge=0)] = 8192
    max_tokens: Annotated[StrictInt, Field(ge=1)] = 256
    max_temperature: Annotated[Float, Field(ge=0)] = 2.0
    max_message_bytes: Annotated[StrictInt, Field(ge=1024)] = 1 << 20
    # A client that sends no deadline gets this one: nothing waits forever.
    default_deadline_s: Annotated[Float, Field(ge=0.001)] = 30.0
    # Read from `inference.max_timeout_ms`, not from `limits`: one key, so the gateway's check
    # (before the cache) and the model's own can never disagree.
    _max_inference_timeout_ms: int = PrivateAttr(default=DEFAULT_MAX_INFERENCE_TIMEOUT_MS)

    # Cached: read per request by the validation stage, and a pydantic private attribute is
    # read through `BaseModel.__getattr__` (an AttributeError raised and caught inside, on
    # every read); once cached it is a plain instance attribute. Equality and
    # dumps ignore it. Set `_max_inference_timeout_ms` before the first read (`from_config`).
    @functools.cached_property
    def max_inference_timeout_ms(self) -> int:
        return self._max_inference_timeout_ms

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> RequestLimits:
        """The `limits` section of a whole config mapping, with the model's timeout cap."""
        limits = cls.parse(config.get("limits"), "limits")
        # The inference section itself is parsed (and a bad value refused) where the model
        # is built; here only its one key is read, so the pipeline needs nothing of inference.
        timeout_ms = section(config, "inference").get("max_timeout_ms", DEFAULT_MAX_INFERENCE_TIMEOUT_MS)
        if isinstance(timeout_ms, int) and not isinstance(timeout_ms, bool):
            limits._max_inference_timeout_ms = timeout_ms
        return limits
