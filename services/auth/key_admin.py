"""What an admin does to managed keys: create, list, update, rotate, revoke.

One class behind both admin APIs (gRPC `KeyAdmin`, HTTP `/admin/keys`) and `spine keys`, on
plain values: a request's fields are checked by `KeySpecInput` (unknown or wrong fields are
refused naming the field), the change is written to the store (`services.auth.key_store`),
and every replica's auth sees it at its next poll. The config file's keys are listed as
read-only entries: they are changed in the file, never here.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

import grpc
from pydantic import Field, StrictInt, field_validator

from services.auth.api_keys import ApiKeyEntry
from services.auth.key_store import KeyConflict, KeyExists, KeyStore, KeyStoreError
from services.auth.managed_keys import SHOWN_CHARS, WINDOWS, KeyHasher, ManagedKey, new_secret
from services.common import Clock, ConfigError
from services.common.admin_token import AdminError
from services.common.config_section import Float, Items, NonEmptyStr, Section, problem
from services.common.sqlite_file import StoreFileGone

_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MAX_OVERLAP_S = 30 * 86400.0
NonNegative = Annotated[Float | StrictInt, Field(ge=0)]


class KeyAdminError(AdminError):
    """A refused key admin call."""


class KeySpecInput(Section):
    """The fields a create or an update may set, as an admin sends them."""

    id: NonEmptyStr | None = None
    tenant: NonEmptyStr | None = None
    team: str | None = None
    scopes: Items[NonEmptyStr] | None = None
    max_priority: Annotated[StrictInt, Field(ge=0, le=1)] | None = None
    models: Items[NonEmptyStr] | None = None
    requests_per_minute: NonNegative | None = None
    tokens_per_minute: NonNegative | None = None
    budget_usd: NonNegative | None = None
    budget_window: str | None = None
    expires_at: NonNegative | None = None
    expires_in_s: Annotated[Float | StrictInt, Field(gt=0)] | None = None

    @field_validator("id")
    @classmethod
    def _id_shape(cls, value: str | None) -> str | None:
        if value is not None and not _ID.fullmatch(value):
            raise problem("expected 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit",
                          show_input=True)
        return value

    @field_validator("budget_window")
    @classmethod
    def _window(cls, value: str | None) -> str | None:
        if value is not None and value not in WINDOWS:
            raise problem(f"expected one of {', '.join(WINDOWS)}", show_input=True)
        return value


class KeyAdmin:
    """The admin operations on one key store."""

    def __init__(self, store: KeyStore, hasher: KeyHasher, config_keys: Sequence[ApiKeyEntry] = (),
                 clock: Clock = time.time) -> None:
        self.store = store
        self._hasher = hasher
        self._config_keys = {entry.id: entry for entry in config_keys}
        self._clock = clock

    # -- the operations -------------------------------------------------------------------
    def create(self, fields: Mapping[str, Any]) -> tuple[ManagedKey, str]:
        """A new key and its secret (shown this once)."""
        spec = _parse(fields)
        if spec.tenant is None:
            raise KeyAdminError(grpc.StatusCode.INVALID_ARGUMENT, "tenant: a key needs a tenant")
        key_id = spec.id or f"key-{secrets.token_hex(6)}"
        if key_id in self._config_keys:
            raise KeyAdminError(grpc.StatusCode.ALREADY_EXISTS, f"id {key_id!r} is a key of the config file")
        secret = new_secret()
        now = self._clock()
        values = _values(spec, now)
        values.setdefault("scopes", ("generate",))
        key = ManagedKey(id=key_id, digest=self._hasher.digest(secret), shown=secret[:SHOWN_CHARS] + "…",
                         created_at=now, **values)
        _check(key)
        try:
            self.store.create(key)
        except KeyExists as error:
            raise KeyAdminError(grpc.StatusCode.ALREADY_EXISTS, str(error)) from None
        except StoreFileGone as error:  # a key that would vanish at the restart: refused, saying why
            raise KeyAdminError(grpc.StatusCode.UNAVAILABLE, str(error)) from None
        return key, secret

    def list(self, tenant: str = "", team: str = "", include_revoked: bool = False) -> list[dict[str, Any]]:
        """Every key (never a secret or a hash): the config file's, then the managed ones by id."""
        now = self._clock()
        _, managed = self.store.load()
        rows = [self._config_row(entry) for entry in self._config_keys.values()]
        rows += [key.public(now) for key in sorted(managed, key=lambda k: k.id)
                 if include_revoked or not key.revoked_at]
        return [row for row in rows if (not tenant or row["tenant"] == tenant) and (not team or row["team"] == team)]

    def get(self, key_id: str) -> dict[str, Any]:
        if key_id in self._config_keys:
            return self._config_row(self._config_keys[key_id])
        return self._stored(key_id).public(self._clock())

    def update(self, key_id: str, fields: Mapping[str, Any]) -> dict[str, Any]:
        spec = _parse(fields)
        if spec.id is not None and spec.id != key_id:
            raise KeyAdminError(grpc.StatusCode.INVALID_ARGUMENT, "id: a key's id cannot change")
        key = self._writable(key_id)
        changed = key.changed(**_values(spec, self._clock()))
        _check(changed)
        self._write(changed, key.version)
        return changed.public(self._clock())

    def rotate(self, key_id: str, overlap_s: float) -> tuple[ManagedKey, str]:
        """A new secret for the key; the old one keeps working `overlap_s` more seconds."""
        if not 0 <= overlap_s <= MAX_OVERLAP_S:
            raise KeyAdminError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"overlap_s: must be within 0 and {MAX_OVERLAP_S:g} (30 days), got {overlap_s:g}")
        key = self._writable(key_id)
        secret = new_secret()
        now = self._clock()
        rotated = key.changed(digest=self._hasher.digest(secret), shown=secret[:SHOWN_CHARS] + "…",
                              previous_digest=key.digest if overlap_s else "",
                              previous_until=now + overlap_s if overlap_s else 0.0)
        self._write(rotated, key.version)
        return rotated, secret

    def revoke(self, key_id: str) -> dict[str, Any]:
        key = self._writable(key_id)
        if key.revoked_at:
            return key.public(self._clock())
        revoked = key.changed(revoked_at=self._clock(), previous_digest="", previous_until=0.0)
        self._write(revoked, key.version)
        return revoked.public(self._clock())

    # -- helpers --------------------------------------------------------------------------
    def _stored(self, key_id: str) -> ManagedKey:
        key = self.store.get(key_id)
        if key is None:
            raise KeyAdminError(grpc.StatusCode.NOT_FOUND, f"no key {key_id!r}")
        return key

    def _writable(self, key_id: str) -> ManagedKey:
        if key_id in self._config_keys:
            raise KeyAdminError(grpc.StatusCode.FAILED_PRECONDITION,
                                f"key {key_id!r} is read-only: it comes from the config file (auth.api_keys); "
                                "change it there")
        key = self._stored(key_id)
        if key.revoked_at:
            raise KeyAdminError(grpc.StatusCode.FAILED_PRECONDITION, f"key {key_id!r} is revoked")
        return key

    def _write(self, key: ManagedKey, read_version: int) -> None:
        try:
            self.store.update(key, read_version)
        except KeyConflict as error:
            raise KeyAdminError(grpc.StatusCode.ABORTED, str(error)) from None
        except StoreFileGone as error:
            raise KeyAdminError(grpc.StatusCode.UNAVAILABLE, str(error)) from None
        except KeyStoreError as error:
            raise KeyAdminError(grpc.StatusCode.NOT_FOUND, str(error)) from None

    @staticmethod
    def _config_row(entry: ApiKeyEntry) -> dict[str, Any]:
        return {"id": entry.id, "tenant": entry.tenant, "team": "", "scopes": list(entry.scopes),
                "max_priority": entry.max_priority, "models": [], "requests_per_minute": 0.0,
                "tokens_per_minute": 0.0, "budget_usd": 0.0, "budget_window": "", "expires_at": 0.0,
                "created_at": 0.0, "revoked_at": 0.0, "previous_until": 0.0, "shown": "", "read_only": True,
                "version": 0, "state": "active"}


def _parse(fields: Mapping[str, Any]) -> KeySpecInput:
    try:
        return KeySpecInput.parse(dict(fields), "key")
    except ConfigError as error:
        raise KeyAdminError(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from None


def _values(spec: KeySpecInput, now: float) -> dict[str, Any]:
    """The record fields `spec` sets (expires_in_s made a time)."""
    values = spec.model_dump(exclude_none=True, exclude={"id", "expires_in_s"})
    for name in ("scopes", "models"):
        if name in values:
            values[name] = tuple(values[name])
    for name in ("requests_per_minute", "tokens_per_minute", "budget_usd", "expires_at"):
        if name in values:
            values[name] = float(values[name])
    if spec.expires_in_s is not None:
        values["expires_at"] = now + float(spec.expires_in_s)
    return values


def _check(key: ManagedKey) -> None:
    if not key.tenant:
        raise KeyAdminError(grpc.StatusCode.INVALID_ARGUMENT, "tenant: a key needs a tenant")
