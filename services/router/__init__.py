"""Routing: a model id or alias becomes (canonical model id, backend), with an optional fallback.

Modules: `service` (the `spine.v1.Router` servicer), `config` (its config section: models,
aliases, fallbacks), `steps` (its pipeline step, after rate limiting and before the cache).
"""
