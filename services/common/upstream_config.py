"""`router.models[].upstream`: a model served by an OpenAI- or Anthropic-compatible server.

Shared by the router (which checks and names the route) and the inference component (which
calls the upstream), so it lives below both: the middlewares never import each other. A
light module (pydantic only).

    router:
      models:
        - id: llama
          upstream: {base_url: http://127.0.0.1:8001/v1, api_key_file: /run/secrets/vllm, protocol: openai,
                     timeout_s: 30, max_connections: 64, fallbacks: [llama-b], context_fallback: llama-long}
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Literal, Protocol
from urllib.parse import urlsplit

from pydantic import Field, StrictBool, StrictInt, field_validator

from services.common.config_section import Float, Items, NonEmptyStr, Section, problem

WireProtocol = Literal["openai", "anthropic"]


class UpstreamSpec(Section):
    """Where a model is served and how the spine calls it (every key in runtime/default_config.yaml)."""

    base_url: NonEmptyStr = Field(description="http(s)://HOST:PORT/v1, as the openai SDK takes it")
    api_key_file: Path | None = Field(default=None, description="the upstream's key, read at start, never logged")
    protocol: WireProtocol = "openai"
    model: NonEmptyStr | None = Field(default=None, description="the name the upstream knows the model by "
                                                                "(default: the route's id)")
    timeout_s: Annotated[Float, Field(gt=0)] = 60.0
    connect_timeout_s: Annotated[Float, Field(gt=0)] = 2.0
    max_connections: Annotated[StrictInt, Field(ge=1)] = 100
    http2: StrictBool = True
    ca_file: Path | None = Field(default=None, description="https: verify the upstream against this CA "
                                                           "(default: the system's roots)")
    retries: Annotated[StrictInt, Field(ge=0, le=5)] = 2
    retry_budget: Annotated[Float, Field(ge=0, le=1)] = 0.2
    min_retries_per_s: Annotated[Float, Field(ge=0)] = 5.0
    max_retry_after_s: Annotated[Float, Field(ge=0)] = 1.0
    fallbacks: Items[NonEmptyStr] = ()
    context_fallback: NonEmptyStr | None = None
    eject_after_failures: Annotated[StrictInt, Field(ge=1)] = 5
    ejection_s: Annotated[Float, Field(gt=0)] = 1.0
    max_ejection_s: Annotated[Float, Field(gt=0)] = 30.0
    tokenizer_file: Path | None = Field(default=None, description="the upstream model's Hugging Face "
                                        "tokenizer.json: an answer without usage is counted with it (needs the "
                                        "tokenizers package, the hf extra); without it, estimated")

    @field_validator("base_url")
    @classmethod
    def _is_an_http_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise problem("expected http(s)://HOST[:PORT]/PATH (the openai SDK's base_url, e.g. "
                          "http://127.0.0.1:8001/v1)", show_input=True)
        if parts.query or parts.fragment or parts.username or parts.password:
            raise problem("no query, fragment or credentials in the URL: the key goes in api_key_file")
        return value.rstrip("/")

    @field_validator("api_key_file", "ca_file")
    @classmethod
    def _is_readable(cls, value: Path | None) -> Path | None:
        """Checked when the config is read, so `spine config check` refuses what `spine up` would
        (with the key's FILE:LINE); the key itself is still read only when the endpoint starts."""
        if value is None:
            return None
        try:
            with value.open("rb") as file:
                empty = not file.read(4096).strip()
        except OSError as error:
            raise problem(f"cannot read {value}: {error.strerror}") from None
        if empty:
            raise problem(f"{value} is empty")
        return value


class Route(Protocol):
    """A router model as `upstream_routes` reads it (`services.router.config.ModelRoute`)."""

    @property
    def id(self) -> str: ...

    @property
    def aliases(self) -> tuple[str, ...]: ...

    @property
    def upstream(self) -> UpstreamSpec | None: ...


def upstream_routes(models: Sequence[Route]) -> dict[str, UpstreamSpec]:
    """Every router model with an `upstream:` block, by id (from a validated `router` section);
    the fallbacks it names (ids or aliases) resolved to ids."""
    ids = {model.id: model.id for model in models}
    ids.update({alias: model.id for model in models for alias in model.aliases})
    routes: dict[str, UpstreamSpec] = {}
    for model in models:
        spec = model.upstream
        if spec is None:
            continue
        context = spec.context_fallback
        routes[model.id] = spec.model_copy(update={
            "fallbacks": tuple(ids.get(name, name) for name in spec.fallbacks),
            "context_fallback": None if context is None else ids.get(context, context)})
    return routes
