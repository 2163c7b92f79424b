"""Request validation limits (the `limits` config section, plus the model's timeout cap)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, StrictInt
from pydantic.json_schema import SkipJsonSchema

from services.common.config_section import Float, Section

# The default of `inference.max_timeout_ms` (the inference section takes it from here: the
# gateway's check and the model's own read one key and one default).
DEFAULT_MAX_INFERENCE_TIMEOUT_MS = 120_000
# A gRPC call sent without a deadline reports a time remaining far in the future (its
# deadline is "infinite"): past this many seconds, the caller set none.
NO_DEADLINE_S = 1e6


class RequestLimits(Section):
    """The `limits` section. Checked by the gateway's validation stage, in every layout."""

    where = "limits"

    max_prompt_chars: Annotated[StrictInt, Field(ge=1)] = 2048
    max_system_chars: Annotated[StrictInt, Field(ge=0)] = 8192
    max_tokens: Annotated[StrictInt, Field(ge=1)] = 256
    max_temperature: Annotated[Float, Field(ge=0)] = 2.0
    max_message_bytes: Annotated[StrictInt, Field(ge=1024)] = 1 << 20
    # A client that sends no deadline gets this one: nothing waits forever.
    default_deadline_s: Annotated[Float, Field(ge=0.001)] = 30.0
    # Not a key of `limits`: the model's own cap, `inference.max_timeout_ms`, which the whole
    # config copies in here (one key, so the gateway's check before the cache and the model's
    # own can never disagree). Left out of dumps and the schema; the config refuses it under
    # `limits:`.
    max_inference_timeout_ms: SkipJsonSchema[StrictInt] = Field(default=DEFAULT_MAX_INFERENCE_TIMEOUT_MS,
                                                                exclude=True)
