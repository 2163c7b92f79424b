"""The `auth` config section: API keys (digests only once loaded), JWT settings, the verification cache.

What only the serving process can resolve (an environment variable's secret, a key file) is
read by `AuthService` when it starts, from this same section.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, SecretStr, StrictInt, field_validator

from services.auth.api_keys import ApiKeyEntry, check_unique
from services.auth.jwt_verify import JwtSection
from services.common.config_section import Float, Items, NonEmptyStr, Section

MAX_DENIAL_TTL_S = 10.0


class CacheSettings(Section):
    """`auth.cache`: the JWT verification cache."""

    max_entries: Annotated[StrictInt, Field(ge=0)] = 4096  # 0 turns the cache off
    max_ttl_s: Annotated[Float, Field(ge=0)] = 300.0  # cap on an accepted verdict, even for long-lived tokens
    # A denial is kept only briefly, so a clock-skewed `nbf` heals quickly.
    denial_ttl_s: Annotated[Float, Field(ge=0, le=MAX_DENIAL_TTL_S)] = 2.0


# The development defaults: one API key and an HS256 secret anyone can read in this file, so a
# fresh checkout answers at once. A deployment names its own (`api_keys` with `key_sha256`, a
# `jwt` with `hs256_secret_env` or public keys); `deploy/` shows how.
DEV_API_KEY = "spine-dev-key-0000"
DEV_KEYS = (ApiKeyEntry(id="dev-key", tenant="dev", key=SecretStr(DEV_API_KEY), scopes=("generate",), max_priority=1),)
DEV_JWT = JwtSection(issuer="spine-dev", audience="spine", leeway_s=30.0,
                     hs256_secret=SecretStr("spine-dev-jwt-secret-change-me-0123456789"))


class AuthConfig(Section):
    """The `auth` section."""

    where = "auth"

    api_keys: Items[ApiKeyEntry] = DEV_KEYS
    jwt: JwtSection | None = DEV_JWT
    required_scope: NonEmptyStr = "generate"
    cache: CacheSettings = CacheSettings()

    @field_validator("api_keys")
    @classmethod
    def _unique(cls, entries: tuple[ApiKeyEntry, ...]) -> tuple[ApiKeyEntry, ...]:
        check_unique(entries)
        return entries
