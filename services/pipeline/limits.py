"""Request validation limits (the `limits` config section, plus the model's timeout cap), and
the limits of each model sized from its context length (`ModelSizes`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, NamedTuple

from pydantic import Field, PrivateAttr, StrictInt
from pydantic.json_schema import SkipJsonSchema

from services.common.config_section import Float, Section
from services.common.engine_context import Engine, EngineContexts

# The default of `inference.max_timeout_ms` (the inference section takes it from here: the
# gateway's check and the model's own read one key and one default).
DEFAULT_MAX_INFERENCE_TIMEOUT_MS = 120_000
# A gRPC call sent without a deadline reports a time remaining far in the future (its
# deadline is "infinite"): past this many seconds, the caller set none.
NO_DEADLINE_S = 1e6
# Characters of prompt a context of one token may hold, for `max_prompt_chars`: a token is three
# to four characters of English, fewer of code or other scripts. Generous on purpose: a prompt
# the gateway lets through but the engine cannot hold is refused by the engine as too long for
# its context (a 400 naming it, or the context fallback), while one the gateway refused would
# never have had the chance.
CHARS_PER_TOKEN = 8


class SizeLimits(NamedTuple):
    """What a request to one model may ask for: answer tokens and prompt characters, and where
    the numbers come from (said in the refusal, so a client knows which knob is whose)."""

    max_tokens: int
    max_prompt_chars: int
    source: str


@dataclass
class ModelSizes:
    """The context length of each model, by every name it is called (id and aliases): set in the
    config (`router.models[].context_length`, or the built-in model's `max_context`), or read from
    an upstream engine (`engines`, asked off the request path by `EngineContexts`). A model whose
    context is not known keeps `limits.max_tokens` and `limits.max_prompt_chars`."""

    contexts: Mapping[str, int] = field(default_factory=dict)
    engines: Mapping[str, Engine] = field(default_factory=dict)
    asked: EngineContexts | None = None

    def context(self, model: str) -> tuple[int, str] | None:
        """(context length, where it was read) of `model`, or None when not known (yet)."""
        if model in self.contexts:
            return self.contexts[model], "its context length"
        engine = self.engines.get(model)
        if engine is not None and self.asked is not None:
            length = self.asked.get(engine)
            if length is not None:
                return length, "its engine's context length"
        return None

    def start(self) -> ModelSizes:
        """Ask every upstream engine whose context is not set in the config (once each)."""
        if self.engines and self.asked is None:
            self.asked = EngineContexts()
        for engine in set(self.engines.values()):
            assert self.asked is not None
            self.asked.ask(engine)
        return self

    def stop(self) -> None:
        if self.asked is not None:
            self.asked.stop()


class RequestLimits(Section):
    """The `limits` section. Checked by the gateway's validation step, in every layout."""

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
    _sizes: ModelSizes = PrivateAttr(default_factory=ModelSizes)

    def sized(self, sizes: ModelSizes) -> RequestLimits:
        """A copy whose `for_model` sizes each model by `sizes` (the config stays as it was read)."""
        copy = self.model_copy()
        copy._sizes = sizes
        return copy

    def for_model(self, model: str) -> SizeLimits:
        """The limits of a request to `model` (any of its names): from its context length when
        known — the answer may take the whole context, the prompt `CHARS_PER_TOKEN` characters a
        token of it — else this section's `max_tokens` and `max_prompt_chars`."""
        known = self._sizes.context(model)
        if known is None:
            return SizeLimits(self.max_tokens, self.max_prompt_chars, "limits.max_tokens / limits.max_prompt_chars")
        length, where = known
        return SizeLimits(length, length * CHARS_PER_TOKEN, f"{where}, {length} tokens")
