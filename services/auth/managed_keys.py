"""API keys managed at run time: the record a key store holds, and how a key is made and hashed.

A key is shown once, when it is made (`new_secret`); the store keeps only its keyed hash
(HMAC-SHA256 with a server secret every replica shares, `KeyHasher`), so a copy of the store
is no list of working keys, nor a table one could match guesses against offline without the
secret. A record also carries what the key may do: its tenant and team, the models it may
name, its own limits and its budget, its expiry. Rotating a key keeps the old hash valid
until a stated time, so clients can move over without an outage.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal

import orjson

KEY_PREFIX = "sk-spine-"
SHOWN_CHARS = 14  # how much of a key a listing shows: enough to tell keys apart, useless to an attacker
BudgetWindow = Literal["daily", "monthly"]
WINDOWS: tuple[str, ...] = ("daily", "monthly")


def new_secret() -> str:
    """A fresh key: the prefix and 256 random bits."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


class KeyHasher:
    """HMAC-SHA256 under the server secret: the digest a key is stored and looked up by.

    Computed as RFC 2104 defines it, from the two padded-key SHA-256 states made once: a
    lookup copies them instead of keying an HMAC again (0.6 us instead of 1.6 us, on every
    API key check; `hmac.digest` gives the same bytes, the tests compare them)."""

    _BLOCK = 64  # SHA-256's block size

    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise ValueError("the key store's HMAC secret must be at least 16 bytes")
        key = hashlib.sha256(secret).digest() if len(secret) > self._BLOCK else secret
        key = key.ljust(self._BLOCK, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in key))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in key))

    def raw(self, credential: str) -> bytes:
        """The digest as bytes."""
        inner = self._inner.copy()
        inner.update(credential.encode("utf-8"))
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()

    def digest(self, credential: str) -> str:
        """The digest as hex (what the store keeps)."""
        return self.raw(credential).hex()


@dataclass(frozen=True)
class ManagedKey:
    """One key as the store holds it (never its plaintext)."""

    id: str
    tenant: str
    digest: str  # HMAC hex of the current key
    shown: str  # the key's first characters, for a person to recognise it
    created_at: float
    team: str = ""
    scopes: tuple[str, ...] = ("generate",)
    max_priority: int = 0
    models: tuple[str, ...] = ()  # model ids or aliases it may name; empty: every model
    requests_per_minute: float = 0.0  # its own limits (0: none beyond its tenant's)
    tokens_per_minute: float = 0.0
    budget_usd: float = 0.0  # what it may spend per window (0: no budget)
    budget_window: BudgetWindow = "monthly"
    expires_at: float = 0.0  # unix seconds (0: never)
    revoked_at: float = 0.0  # unix seconds (0: not revoked)
    previous_digest: str = ""  # the key before the last rotation, valid until `previous_until`
    previous_until: float = 0.0
    read_only: bool = False  # from the config file: changed there, not through the admin API
    version: int = 1  # bumped by every change (a verdict made for an older one is stale)

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> ManagedKey:
        data: dict[str, Any] = orjson.loads(raw)
        known = {f.name for f in fields(cls)}
        data = {k: v for k, v in data.items() if k in known}  # a newer writer's extra fields are skipped
        for name in ("scopes", "models"):
            data[name] = tuple(data.get(name, ()))
        return cls(**data)

    def changed(self, **changes: Any) -> ManagedKey:
        return replace(self, version=self.version + 1, **changes)

    def state(self, now: float) -> str:
        """`active`, `expired` or `revoked` at `now`."""
        if self.revoked_at and self.revoked_at <= now:
            return "revoked"
        if self.expires_at and self.expires_at <= now:
            return "expired"
        return "active"

    def public(self, now: float) -> dict[str, Any]:
        """What a listing shows: everything but the hashes."""
        out = {k: v for k, v in asdict(self).items() if k not in ("digest", "previous_digest")}
        out["scopes"], out["models"] = list(self.scopes), list(self.models)
        out["state"] = self.state(now)
        return out
