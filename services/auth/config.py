"""The `auth` config section: API keys (digests only once loaded), JWT settings, the verification cache.

What only the serving process can resolve (an environment variable's secret, a key file) is
read by `AuthService` when it starts, from this same section.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field, SecretStr, StrictBool, StrictInt, field_validator, model_validator

from services.auth.api_keys import ApiKeyEntry, check_unique
from services.auth.jwt_verify import JwtSection
from services.common.config_section import Float, Items, NonEmptyStr, Section, problem
from services.common.redis_link import RedisLink

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


class KeyStoreRedis(RedisLink):
    """`auth.store.redis`: the Redis the replicas share (the rate limiter's, say), keys under their own prefix."""

    key_prefix: NonEmptyStr = "spine:keys:"


class KeyStoreSection(Section):
    """`auth.store`: where keys managed at run time (the admin API, `spine keys`) are kept.

    Redis for replicas (`redis`, with `hmac_secret_file`: the secret every replica hashes keys
    with), else a sqlite file (`sqlite`, default `keys.sqlite` in the run directory, its secret
    made beside it at first start). Every replica polls the store's version every `poll_s` and
    serves from its last copy while the store cannot be read."""

    enabled: StrictBool = True
    redis: KeyStoreRedis | None = None
    sqlite: Path | None = None
    hmac_secret_file: Path | None = None
    poll_s: Annotated[Float, Field(gt=0, le=1)] = 0.2

    @model_validator(mode="after")
    def _one_store(self) -> KeyStoreSection:
        if self.redis is not None and self.sqlite is not None:
            raise problem("give one of `redis` or `sqlite`, not both")
        if self.redis is not None and self.hmac_secret_file is None:
            raise problem("with `redis`, give `hmac_secret_file`: the secret every replica hashes keys with "
                          "(a file of the same 32+ random bytes on each, mode 600)", "hmac_secret_file")
        return self


class AuthConfig(Section):
    """The `auth` section."""

    where = "auth"

    api_keys: Items[ApiKeyEntry] = DEV_KEYS
    jwt: JwtSection | None = DEV_JWT
    required_scope: NonEmptyStr = "generate"
    cache: CacheSettings = CacheSettings()
    store: KeyStoreSection = KeyStoreSection()

    @field_validator("api_keys")
    @classmethod
    def _unique(cls, entries: tuple[ApiKeyEntry, ...]) -> tuple[ApiKeyEntry, ...]:
        check_unique(entries)
        return entries
