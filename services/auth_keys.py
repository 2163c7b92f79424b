"""API keys: parsed from config, held only as SHA-256 digests, looked up by a bearer string.

The plaintext of a key is hashed at load and dropped, so a heap dump or a config echo of
the running service never shows a usable key. Production configs give `key_sha256`
directly; `key` exists for the dev tenant.

This module also holds the small config readers the auth modules share, so every auth
config error has the same shape: `auth.<path>: <what is wrong>, got <value>`.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.common import ConfigError

_SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")
_KEY_FIELDS = ("id", "tenant", "key", "key_sha256", "scopes", "max_priority")


# --- config readers shared by the auth modules ---------------------------------------------


def expect_mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def expect_fields(cfg: Mapping[str, Any], allowed: Collection[str], where: str) -> None:
    """Reject unknown fields: a typo (`scope:` for `scopes:`) must not silently drop a setting."""
    for name in cfg:
        if name not in allowed:
            raise ConfigError(f"{where}: unknown field {name!r}; expected one of {', '.join(allowed)}")


def required_text(cfg: Mapping[str, Any], key: str, where: str) -> str:
    value = cfg.get(key)
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where}.{key}: expected a non-empty string, got {value!r}")
    return value


def text_list(cfg: Mapping[str, Any], key: str, where: str) -> tuple[str, ...]:
    value = cfg.get(key, [])
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ConfigError(f"{where}.{key}: expected a list of strings, got {value!r}")
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item:
            raise ConfigError(f"{where}.{key}[{i}]: expected a non-empty string, got {item!r}")
    return tuple(value)


def entry_list(cfg: Mapping[str, Any], key: str, where: str) -> list[Mapping[str, Any]]:
    value = cfg.get(key, [])
    if value is None:
        return []
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ConfigError(f"{where}.{key}: expected a list, got {type(value).__name__}")
    return [expect_mapping(item, f"{where}.{key}[{i}]") for i, item in enumerate(value)]


# --- API keys ------------------------------------------------------------------------------


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


def parse_api_key(cfg: Mapping[str, Any], where: str) -> ApiKey:
    expect_fields(cfg, _KEY_FIELDS, where)
    key_id = required_text(cfg, "id", where)
    tenant = required_text(cfg, "tenant", where)
    has_key, has_hash = cfg.get("key") is not None, cfg.get("key_sha256") is not None
    if has_key == has_hash:
        raise ConfigError(f"{where}: give exactly one of `key` or `key_sha256` (key id {key_id!r})")
    if has_key:
        plain = cfg["key"]
        if not isinstance(plain, str) or not plain:
            # Never echo the value: it may be a real key pasted into the wrong place.
            raise ConfigError(f"{where}.key: expected a non-empty string, got {type(plain).__name__}")
        digest = key_digest(plain)
    else:
        hexed = cfg["key_sha256"]
        if not isinstance(hexed, str) or not _SHA256_HEX.fullmatch(hexed):
            raise ConfigError(f"{where}.key_sha256: expected 64 hex characters (sha256 of the key)")
        digest = bytes.fromhex(hexed)
    max_priority = cfg.get("max_priority", 0)
    if isinstance(max_priority, bool) or not isinstance(max_priority, int) or max_priority < 0:
        raise ConfigError(f"{where}.max_priority: expected an integer >= 0, got {max_priority!r}")
    return ApiKey(key_id, tenant, digest, text_list(cfg, "scopes", where), max_priority)


class ApiKeyTable:
    """Keys by digest. The dict lookup runs on a digest the caller cannot steer, and the hit is
    confirmed with `hmac.compare_digest`, so timing says nothing useful about stored keys."""

    def __init__(self, keys: Sequence[ApiKey]) -> None:
        self._by_digest: dict[bytes, ApiKey] = {}
        seen_ids: set[str] = set()
        for i, key in enumerate(keys):
            where = f"auth.api_keys[{i}]"
            if key.id in seen_ids:
                raise ConfigError(f"{where}.id: duplicate key id {key.id!r}")
            seen_ids.add(key.id)
            other = self._by_digest.get(key.digest)
            if other is not None:
                raise ConfigError(f"{where}: same key as id {other.id!r}; every key must be distinct")
            self._by_digest[key.digest] = key

    @classmethod
    def from_config(cls, entries: Sequence[Mapping[str, Any]]) -> ApiKeyTable:
        return cls([parse_api_key(entry, f"auth.api_keys[{i}]") for i, entry in enumerate(entries)])

    def __len__(self) -> int:
        return len(self._by_digest)

    def lookup(self, credential: str) -> ApiKey | None:
        digest = key_digest(credential)
        found = self._by_digest.get(digest)
        if found is None or not hmac.compare_digest(found.digest, digest):
            return None
        return found
