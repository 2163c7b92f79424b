"""The `auth` config section: API keys (digests only), JWT settings, the verification cache."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import Field, StrictInt, field_validator

from services.auth.api_keys import ApiKeyEntry, ApiKeyTable, check_unique
from services.auth.jwt_verify import JwtSection, JwtSettings
from services.common.config_section import Float, Items, NonEmptyStr, Section

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


class AuthSection(Section):
    """The `auth` section as written (the root config model's `auth`)."""

    api_keys: Items[ApiKeyEntry] = ()
    jwt: JwtSection | None = None
    required_scope: NonEmptyStr = "generate"
    cache: CacheSettings = CacheSettings()

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

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None) -> AuthConfig:
        """Parse the `auth` section; `environ` (default os.environ) resolves `hs256_secret_env`."""
        return cls.from_section(AuthSection.parse(section, "auth"), environ)

    @classmethod
    def from_section(cls, section: AuthSection, environ: Mapping[str, str] | None = None) -> AuthConfig:
        jwt = None if section.jwt is None else JwtSettings.from_section(section.jwt, "auth.jwt", environ)
        return cls(api_keys=ApiKeyTable.from_entries(section.api_keys), jwt=jwt,
                   required_scope=section.required_scope, cache=section.cache)
