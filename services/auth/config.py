"""The `auth` config section: API keys (digests only), JWT settings, the verification cache."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, StrictBool, StrictInt, field_validator, model_validator

from services.auth.api_keys import ApiKeyEntry, ApiKeyTable, check_unique
from services.auth.jwt_verify import JwtSection, JwtSettings
from services.common.config_section import Float, Items, NonEmptyStr, Section, problem
from services.common.redis_link import RedisLink

MAX_DENIAL_TTL_S = 10.0


class CacheSettings(Section):
    """`auth.cache`: the JWT verification cache."""

    max_entries: Annotated[StrictInt, Field(ge=0)] = 4096  # 0 turns the cache off
    max_ttl_s: Annotated[Float, Field(ge=0)] = 300.0  # cap on an accepted verdict, even for long-lived tokens
    # A denial is kept only briefly, so a clock-skewed `nbf` heals quickly.
    denial_ttl_s: Annotated[Float, Field(ge=0, le=MAX_DENIAL_TTL_S)] = 2.0

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any] | None, where: str = "auth.cache") -> CacheSettings:
        return cls.parse(cfg, where)


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


class AuthSection(Section):
    """The `auth` section as written (the root config model's `auth`)."""

    api_keys: Items[ApiKeyEntry] = ()
    jwt: JwtSection | None = None
    required_scope: NonEmptyStr = "generate"
    cache: CacheSettings = CacheSettings()
    store: KeyStoreSection = KeyStoreSection()

    @field_validator("api_keys")
    @classmethod
    def _unique(cls, entries: tuple[ApiKeyEntry, ...]) -> tuple[ApiKeyEntry, ...]:
        check_unique(entries)
        return entries


@dataclass(frozen=True)
class AuthConfig:
    """What the service runs with: keys as digests only, JWT keys loaded. Built from a validated
    `AuthSection`, so the plaintext of a dev key never outlives loading."""

    api_keys: ApiKeyTable = field(default_factory=lambda: ApiKeyTable([]))
    jwt: JwtSettings | None = None
    required_scope: str = "generate"
    cache: CacheSettings = CacheSettings()
    store: KeyStoreSection = KeyStoreSection()

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None) -> AuthConfig:
        """Parse the `auth` section; `environ` (default os.environ) resolves `hs256_secret_env`."""
        return cls.from_section(AuthSection.parse(section, "auth"), environ)

    @classmethod
    def from_section(cls, section: AuthSection, environ: Mapping[str, str] | None = None) -> AuthConfig:
        jwt = None if section.jwt is None else JwtSettings.from_section(section.jwt, "auth.jwt", environ)
        return cls(api_keys=ApiKeyTable.from_entries(section.api_keys), jwt=jwt,
                   required_scope=section.required_scope, cache=section.cache, store=section.store)
