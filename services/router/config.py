"""The `router:` config section: the served models, their aliases, backends and fallbacks.

A light module (pydantic, no torch): loading or checking a config, or printing its schema,
imports only this; defaults are documented in `runtime/default_config.yaml`.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import (
    Field,
    StrictInt,
    field_validator,
    model_validator,
)

from services.common.config_section import Items, NonEmptyStr, Section, problem
from services.common.upstream_config import UpstreamSpec

# The component that serves a model: the inference component, which calls an upstream
# server itself for a model with `upstream:` (`services.inference.upstream`).
INFERENCE = "inference"


class ModelRoute(Section):
    """A model the router knows: its id, the backend serving it (or the upstream server it is
    served by), other names for it, and the smaller model (an id or alias) a client may use
    while this one is overloaded."""

    id: NonEmptyStr
    backend: NonEmptyStr | None = None
    aliases: Items[NonEmptyStr] = ()
    fallback: NonEmptyStr | None = None
    upstream: UpstreamSpec | None = None
    context_length: Annotated[StrictInt, Field(ge=2)] | None = Field(
        default=None, description="the model's context window in tokens: its requests may ask for that many "
                                  "max_tokens and 8 characters of prompt a token (docs/upstreams.md); default: read "
                                  "from an upstream engine's /v1/models (max_model_len), the built-in model's "
                                  "max_context, else limits.max_tokens and limits.max_prompt_chars")

    @model_validator(mode="after")
    def _served_by_one(self) -> ModelRoute:
        if self.backend is None and self.upstream is None:
            raise problem("give `backend: inference` or an `upstream: {base_url: ...}` block", "backend")
        if self.upstream is not None and self.backend not in (None, INFERENCE):
            raise problem(f"a model with `upstream:` is served by the inference component; leave `backend` out "
                          f"(got {self.backend!r})", "backend")
        return self

    @property
    def served_by(self) -> str:
        return self.backend or INFERENCE


class RouterConfig(Section):
    """The `router` section. Every id and alias names exactly one model: a repeat is an error,
    never a silent "last one wins"."""

    where = "router"

    # Not `min_length`: pydantic would also call a list whose only model is wrong "too short".
    # The default: the built-in model and its smaller fallback (`inference.models`).
    models: Annotated[tuple[ModelRoute, ...], Field(json_schema_extra={"minItems": 1})] = (
        ModelRoute(id="tiny-lm", backend="inference", aliases=("default", "tiny"), fallback="tiny-lm-mini"),
        ModelRoute(id="tiny-lm-mini", backend="inference", aliases=("mini",)),
    )

    @field_validator("models")
    @classmethod
    def _names_are_unique(cls, models: tuple[ModelRoute, ...]) -> tuple[ModelRoute, ...]:
        if not models:
            raise problem("expected a non-empty list of models")
        owner: dict[str, str] = {}  # name -> the field that first claimed it
        for i, model in enumerate(models):
            if model.id in owner:
                raise problem(f"{model.id!r} is already used by {owner[model.id]}", i, "id")
            owner[model.id] = f"router.models[{i}].id"
        for i, model in enumerate(models):
            for j, alias in enumerate(model.aliases):
                if alias in owner:
                    raise problem(f"{alias!r} is already used by {owner[alias]}", i, "aliases", j)
                owner[alias] = f"router.models[{i}].aliases[{j}]"
        index = {name: i for i, model in enumerate(models) for name in (model.id, *model.aliases)}
        for i, model in enumerate(models):
            if model.fallback is None:
                continue
            if model.fallback not in index:
                raise problem(f"{model.fallback!r} is not a model id or alias; known: {', '.join(owner)}",
                              i, "fallback")
            if index[model.fallback] == i:
                raise problem(f"{model.fallback!r} names this model itself", i, "fallback")
        for i, model in enumerate(models):
            if model.upstream is not None:
                _check_upstream_fallbacks(models, index, i, model.upstream)
        return models

    def fallback_ids(self) -> dict[str, str]:
        """Each model id with a fallback -> the id of that fallback (its alias resolved)."""
        names = {model.id: model.id for model in self.models}
        names.update({alias: model.id for model in self.models for alias in model.aliases})
        return {model.id: names[model.fallback] for model in self.models if model.fallback is not None}


def _check_upstream_fallbacks(models: tuple[ModelRoute, ...], index: dict[str, int], i: int,
                              upstream: UpstreamSpec) -> None:
    """An upstream's `fallbacks` and `context_fallback` name other upstream models (the
    inference component tries them before the first byte, with the same request)."""
    named: list[tuple[tuple[str | int, ...], str]] = [(("upstream", "fallbacks", j), name)
                                                      for j, name in enumerate(upstream.fallbacks)]
    if upstream.context_fallback is not None:
        named.append((("upstream", "context_fallback"), upstream.context_fallback))
    for at, name in named:
        target = index.get(name)
        if target is None:
            raise problem(f"{name!r} is not a model id or alias", i, *at)
        if target == i:
            raise problem(f"{name!r} names this model itself", i, *at)
        if models[target].upstream is None:
            raise problem(f"{name!r} is not served by an upstream (only upstream models stand in for each other)",
                          i, *at)
