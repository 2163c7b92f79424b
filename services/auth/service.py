"""The Auth service: a bearer credential (API key or JWT) becomes a principal, or a denial.

`CheckBatch` decides many credentials at once (the pipeline's auth step calls it, in
either layout); the per-request `Check` is its batch of one. Everything fails closed: any error while verifying is
UNAUTHENTICATED, and no message ever quotes the credential or a secret.

Repeat JWTs hit a verification cache keyed on sha256(token): a signature check costs
50-100 us, a dict hit well under one. An accepted verdict is kept no later than the token's
`exp`; a denial only for a few seconds, so a clock-skewed `nbf` heals quickly.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from services.auth.api import CHECK_BATCH
from services.auth.api_keys import ApiKeyTable
from services.auth.config import AuthConfig
from services.auth.jwt_verify import JwtSettings, JwtVerifier, TokenRejected, looks_like_jwt
from services.auth.live_keys import LiveKeys
from services.auth.managed_keys import ManagedKey
from services.common import Clock, DeviceState
from services.pipeline.batch_rpc import ItemError
from services.pipeline.interface import NO_OPTIONS, CallOptions
from wire.v1 import auth_pb2, auth_pb2_grpc

_UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


class AuthDenied(Exception):
    """A credential that does not authenticate (or authorize); `message` is safe to send back."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


Verdict = auth_pb2.CheckResponse | AuthDenied


class VerdictCache:
    """LRU of verdicts by token digest, each with its own deadline on the injected clock."""

    def __init__(self, max_entries: int, clock: Clock) -> None:
        self._max = max_entries
        self._clock = clock
        self._entries: OrderedDict[bytes, tuple[float, Verdict]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0  # counters for metrics (and for tests: a hit skipped a signature check)
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, digest: bytes) -> Verdict | None:
        now = self._clock()
        with self._lock:
            hit = self._entries.get(digest)
            if hit is not None and now >= hit[0]:
                del self._entries[digest]
                hit = None
            if hit is None:
                self.misses += 1
                return None
            self.hits += 1
            verdict = hit[1]
            self._entries.move_to_end(digest)
        return _fresh(verdict)

    def put(self, digest: bytes, verdict: Verdict, until: float) -> None:
        if self._max == 0 or until <= self._clock():
            return
        with self._lock:
            self._entries[digest] = (until, verdict)
            self._entries.move_to_end(digest)
            while len(self._entries) > self._max:
                self._entries.popitem(last=False)


def _fresh(verdict: Verdict) -> Verdict:
    """A denial as a new exception, so raising it never chains a traceback onto the cached
    one; an accepted verdict as it is: verdicts are shared read-only (`check`), and
    `verify` hands its callers a copy."""
    if isinstance(verdict, AuthDenied):
        return AuthDenied(verdict.code, verdict.message)
    return verdict


def _copy(response: auth_pb2.CheckResponse) -> auth_pb2.CheckResponse:
    copy = auth_pb2.CheckResponse()
    copy.CopyFrom(response)
    return copy


class AuthService(auth_pb2_grpc.AuthServicer):
    """Serves `spine.v1.Auth` from the `auth` section. Keys are kept as digests only, so the
    plaintext of a dev key never outlives the start; `hs256_secret_env` is read from `environ`
    (default os.environ) and `pem_file`s from disk here, in the process that serves auth: a
    ConfigError names the field when one cannot be used. Keys managed at run time
    (`live_keys`, from the key store) are looked up before the config's."""

    def __init__(self, config: AuthConfig, device: DeviceState | None = None, clock: Clock = time.time,
                 environ: Mapping[str, str] | None = None, live_keys: LiveKeys | None = None) -> None:
        # Not the section itself: a dev key's plaintext must not outlive the start.
        self.required_scope = config.required_scope
        self.cache_settings = config.cache
        self.device = device  # auth keeps no tensor state; accepted for a uniform constructor
        self._clock = clock
        self.keys = ApiKeyTable.from_entries(config.api_keys)
        jwt = None if config.jwt is None else JwtSettings.from_section(config.jwt, "auth.jwt", environ)
        self._jwt = None if jwt is None else JwtVerifier(jwt, clock)
        self.cache = VerdictCache(config.cache.max_entries, clock)
        # An API key's verdict changes only with its record: made once per config key, and
        # once per (managed key, record version), shared read-only by every check of that key.
        self._key_verdicts: dict[str, auth_pb2.CheckResponse | ItemError] = {}
        self._managed_verdicts: dict[tuple[str, int], auth_pb2.CheckResponse | ItemError] = {}
        # Keys managed at run time (`services.auth.live_keys`), looked up before the config's.
        self.live_keys = live_keys
        self.store_collector = None if live_keys is None else live_keys.collector()
        # The gateway's health reads it (`runtime.placement.components`): the key store's state.
        self.local_health = None if live_keys is None else live_keys.health

    def close(self) -> None:
        """Stop polling the key store."""
        if self.live_keys is not None:
            self.live_keys.close()

    def check(self, credentials: Sequence[str], options: CallOptions = NO_OPTIONS) -> list[auth_pb2.CheckResponse | ItemError]:
        """One verdict per credential, in order: its principal, or the item's denial.

        A credential repeated in the batch (one client's requests arriving together, the
        common case) is verified once and its verdict shared. The verdicts are what one by
        one would give; only the JWT verification cache's hit/miss counters differ. They
        are shared, read-only objects: copy one before changing it (`CheckBatch` does)."""
        seen: dict[str, auth_pb2.CheckResponse | ItemError] = {}
        verdicts = []
        for credential in credentials:
            verdict = seen.get(credential)
            if verdict is None:
                verdict = seen[credential] = self._verdict(credential)
            verdicts.append(verdict)
        return verdicts

    def CheckBatch(self, request: auth_pb2.CheckBatchRequest, context: Any = None) -> auth_pb2.CheckBatchResponse:
        """`check` over the wire: a denial is that item's status, not the call's."""
        return CHECK_BATCH.serve(self, request, context)

    def verify(self, credential: str) -> auth_pb2.CheckResponse:
        """The principal for `credential` (a copy the caller may change), or AuthDenied
        (UNAUTHENTICATED / PERMISSION_DENIED)."""
        verdict = self._verdict(credential)
        if isinstance(verdict, ItemError):
            raise AuthDenied(verdict.code, verdict.message)
        return _copy(verdict)

    def _verdict(self, credential: str) -> auth_pb2.CheckResponse | ItemError:
        try:
            token = _bearer(credential)
            if not token:
                raise AuthDenied(_UNAUTHENTICATED, "missing credential")
            if looks_like_jwt(token):
                return self._verify_jwt(token)
            return self._verify_api_key(token)
        except AuthDenied as denied:
            return ItemError(denied.code, denied.message)
        except Exception:  # fail closed; the exception text may quote the token, so drop it
            return ItemError(_UNAUTHENTICATED, "credential could not be verified")

    def _verify_api_key(self, token: str) -> auth_pb2.CheckResponse | ItemError:
        managed = self.live_keys.lookup(token) if self.live_keys is not None else None
        if managed is not None:
            return self._managed_verdict(managed)
        key = self.keys.lookup(token)
        if key is None:
            raise AuthDenied(_UNAUTHENTICATED, "unknown API key")
        verdict = self._key_verdicts.get(key.id)
        if verdict is None:
            principal = auth_pb2.Principal(
                tenant=key.tenant, scopes=key.scopes, subject=key.id, max_priority=key.max_priority
            )
            try:
                self._authorize(principal)
                verdict = auth_pb2.CheckResponse(principal=principal, method="api_key", expires_at=0.0)
            except AuthDenied as denied:
                verdict = ItemError(denied.code, denied.message)
            self._key_verdicts[key.id] = verdict
        return verdict

    def _managed_verdict(self, key: ManagedKey) -> auth_pb2.CheckResponse | ItemError:
        """A managed key's verdict, made once per version of its record."""
        verdict = self._managed_verdicts.get((key.id, key.version))
        if verdict is None:
            principal = auth_pb2.Principal(
                tenant=key.tenant, scopes=key.scopes, subject=key.id, max_priority=key.max_priority, team=key.team,
                models=key.models, requests_per_minute=key.requests_per_minute,
                tokens_per_minute=key.tokens_per_minute, budget_usd=key.budget_usd,
                budget_window=key.budget_window if key.budget_usd else "")
            try:
                self._authorize(principal)
                verdict = auth_pb2.CheckResponse(principal=principal, method="api_key", expires_at=key.expires_at)
            except AuthDenied as denied:
                verdict = ItemError(denied.code, denied.message)
            if len(self._managed_verdicts) > 4 * max(len(self.live_keys or ()), 256):  # old versions: made again if asked
                self._managed_verdicts.clear()
            self._managed_verdicts[(key.id, key.version)] = verdict
        return verdict

    def _verify_jwt(self, token: str) -> auth_pb2.CheckResponse:
        if self._jwt is None:
            raise AuthDenied(_UNAUTHENTICATED, "JWT credentials are not accepted (auth.jwt is not configured)")
        digest = hashlib.sha256(token.encode("utf-8")).digest()
        cached = self.cache.get(digest)
        if isinstance(cached, AuthDenied):
            raise cached
        if cached is not None:
            return cached
        now = self._clock()
        try:
            response = self._check_token(token)
        except AuthDenied as denied:
            self.cache.put(digest, denied, now + self.cache_settings.denial_ttl_s)
            raise
        self.cache.put(digest, response, min(response.expires_at, now + self.cache_settings.max_ttl_s))
        return response

    def _check_token(self, token: str) -> auth_pb2.CheckResponse:
        assert self._jwt is not None
        try:
            claims = self._jwt.verify(token)
        except TokenRejected as rejected:
            raise AuthDenied(_UNAUTHENTICATED, str(rejected)) from None
        except Exception:
            raise AuthDenied(_UNAUTHENTICATED, "token could not be verified") from None
        principal = auth_pb2.Principal(
            tenant=claims.tenant, scopes=claims.scopes, subject=claims.subject, max_priority=claims.max_priority
        )
        self._authorize(principal)
        return auth_pb2.CheckResponse(principal=principal, method="jwt", expires_at=claims.expires_at)

    def _authorize(self, principal: auth_pb2.Principal) -> None:
        scope = self.required_scope
        if scope not in principal.scopes:
            raise AuthDenied(
                grpc.StatusCode.PERMISSION_DENIED,
                f"tenant {principal.tenant!r} lacks scope {scope!r} (has: {', '.join(principal.scopes) or 'none'})",
            )


def _bearer(credential: str) -> str:
    """Accept the raw token or a whole `Authorization: Bearer <token>` value."""
    token = credential.strip()
    if token[:7].lower() == "bearer ":
        token = token[7:].strip()
    return token

