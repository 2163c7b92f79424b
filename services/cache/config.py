"""The `cache:` config section: TTL, size, and the pre-generated answer table.

A light module (pydantic, no torch): loading or checking a config, or printing its schema,
imports only this; defaults are documented in `runtime/default_config.yaml`.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import (
    Field,
    StrictInt,
)

from services.common.config_section import Float, NonEmptyStr, Section


class CacheConfig(Section):
    """The `cache` section: how many answers are kept, and for how long; and the table of
    pre-generated answers every cache process maps (`spine cache build`)."""

    where = "cache"

    max_entries: Annotated[StrictInt, Field(ge=1)] = 4096
    ttl_s: Annotated[Float, Field(gt=0)] = 300.0
    pregenerated: NonEmptyStr | None = None  # a table file's path (services.cache.pregenerated)
    pregenerated_check_s: Annotated[Float, Field(gt=0)] = 1.0  # how often a lookup checks the file was replaced
