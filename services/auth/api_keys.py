"""API keys: validated from config, held only as SHA-256 digests, looked up by a bearer string.

The plaintext of a key is hashed at load and dropped, so a heap dump or a config echo of
the running service never shows a usable key. Production configs give `key_sha256`
directly; `key` exists for the dev tenant. Neither is ever quoted in a config error.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

from pydantic import Field, SecretStr, StrictInt, StrictStr, field_validator, model_validator

from services.common.config_section import Items, NonEmptyStr, Section, problem

_SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")


@dataclass(frozen=True)
class ApiKey:
    """One configured key, by digest only."""

    id: str
    tenant: str
    digest: bytes  # sha256 of the key's UTF-8 bytes
    scopes: tuple[str, ...]
    max_priority: int


def key_digest(credential: str) -> bytes:
    return hashlib.sha256(credential.encode("utf-8")).digest()


class ApiKeyEntry(Section):
    """One `auth.api_keys` entry as written: exactly one of `key` (dev) or `key_sha256`."""

    id: NonEmptyStr
    tenant: NonEmptyStr
    key: SecretStr | None = Field(default=None, description="the key itself (dev configs only); hashed at load")
    key_sha256: StrictStr | None = Field(default=None, description="sha256 hex of the key",
                                         json_schema_extra={"pattern": _SHA256_HEX.pattern})
    scopes: Items[NonEmptyStr] = ()
    max_priority: Annotated[StrictInt, Field(ge=0)] = 0

    @field_validator("key")
    @classmethod
    def _key_not_empty(cls, key: SecretStr | None) -> SecretStr | None:
        if key is not None and not key.get_secret_value():
            raise problem("expected a non-empty string")
        return key

    @field_validator("key_sha256")
    @classmethod
    def _hash_is_hex(cls, hexed: str | None) -> str | None:
        # Never echoed: it may be a real key pasted into the wrong place.
        if hexed is not None and not _SHA256_HEX.fullmatch(hexed):
            raise problem("expected 64 hex characters (sha256 of the key)")
        return hexed

    @model_validator(mode="after")
    def _exactly_one_key(self) -> ApiKeyEntry:
        if (self.key is None) == (self.key_sha256 is None):
            raise problem(f"give exactly one of `key` or `key_sha256` (key id {self.id!r})")
        return self

    def digest(self) -> bytes:
        if self.key is not None:
            return key_digest(self.key.get_secret_value())
        assert self.key_sha256 is not None
        return bytes.fromhex(self.key_sha256)

    def to_key(self) -> ApiKey:
        return ApiKey(self.id, self.tenant, self.digest(), tuple(self.scopes), self.max_priority)


def check_unique(entries: Sequence[ApiKeyEntry]) -> None:
    """Every id and every key once: raise the problem at the entry that repeats one."""
    ids: set[str] = set()
    owners: dict[bytes, str] = {}
    for i, entry in enumerate(entries):
        if entry.id in ids:
            raise problem(f"duplicate key id {entry.id!r}", i, "id")
        ids.add(entry.id)
        digest = entry.digest()
        if digest in owners:
            raise problem(f"same key as id {owners[digest]!r}; every key must be distinct", i)
        owners[digest] = entry.id


class ApiKeyTable:
    """Keys by digest. The dict lookup runs on a digest the caller cannot steer, and the hit is
    confirmed with `hmac.compare_digest`, so timing says nothing useful about stored keys."""

    def __init__(self, keys: Sequence[ApiKey]) -> None:
        self._by_digest: dict[bytes, ApiKey] = {key.digest: key for key in keys}

    @classmethod
    def from_entries(cls, entries: Sequence[ApiKeyEntry]) -> ApiKeyTable:
        """The table of validated entries (`AuthConfig` has checked that ids and keys are unique)."""
        return cls([entry.to_key() for entry in entries])

    def __len__(self) -> int:
        return len(self._by_digest)

    def lookup(self, credential: str) -> ApiKey | None:
        digest = key_digest(credential)
        found = self._by_digest.get(digest)
        if found is None or not hmac.compare_digest(found.digest, digest):
            return None
        return found

