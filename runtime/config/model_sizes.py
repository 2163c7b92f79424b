"""Each routed model's context length, as the gateway sizes its request limits by it.

From the config where it says: a route's `context_length`, else, for the model the built-in
inference component serves, its backend's `max_context`. An upstream model whose route says
none is asked for it by its engine (`services.common.engine_context`) once the gateway starts.
Every other model keeps `limits.max_tokens` and `limits.max_prompt_chars`.
"""

from __future__ import annotations

from typing import Any

from services.common.engine_context import Engine
from services.pipeline.limits import ModelSizes


def model_sizes(config: Any) -> ModelSizes:
    """The `ModelSizes` of a SpineConfig (not started: `ModelSizes.start` asks the engines)."""
    contexts: dict[str, int] = {}
    engines: dict[str, Engine] = {}
    backend = config.inference.backend
    built_in = backend.options.get("max_context", backend.max_context)
    for route in config.router.models:
        names = (route.id, *route.aliases)
        context = route.context_length
        if context is None and route.upstream is None and route.id == config.inference.model_id \
                and isinstance(built_in, int) and not isinstance(built_in, bool):
            context = built_in
        if context is not None:
            contexts.update(dict.fromkeys(names, context))
        elif route.upstream is not None:
            spec = route.upstream
            engine = Engine(spec.base_url, spec.model or route.id, spec.api_key_file, spec.ca_file,
                            anthropic=spec.protocol == "anthropic")
            engines.update(dict.fromkeys(names, engine))
    return ModelSizes(contexts, engines)
