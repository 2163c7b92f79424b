"""JWT verification: which key may verify which algorithm, and what a valid token says.

Every key is bound to exactly one algorithm at load: the HS256 secret verifies only HS256,
each public key only its own ES256 or RS256. PyJWT is always called with that one-element
`algorithms` list, so a token cannot pick how it is checked: `alg: none` and an HS256 token
"signed" with a public key's PEM (algorithm confusion) both fail.

Time (exp, nbf) is checked against the injected clock rather than PyJWT's wall clock, so the
verification cache and the verifier agree on "now" and tests need no sleeping.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import HMACAlgorithm
from pydantic import Field, SecretStr, StrictStr, field_validator, model_validator

from services.common import Clock, ConfigError
from services.common.config_section import Float, Items, NonEmptyStr, Section, problem

# Three dot-separated base64url parts; the signature may be empty (`alg: none`), so that such
# a token is still treated as a JWT and refused as one rather than as an unknown API key.
_JWT_SHAPE = re.compile(r"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*")
# Registered JWS names: safe to quote back in a message, unlike anything else from a header.
_JWS_NAMES = frozenset({
    "none", "HS256", "HS384", "HS512", "RS256", "RS384", "RS512",
    "ES256", "ES256K", "ES384", "ES512", "PS256", "PS384", "PS512", "EdDSA",
})
MIN_HS256_SECRET_BYTES = 32
MIN_RSA_BITS = 2048


def looks_like_jwt(credential: str) -> bool:
    # Two dots first: an API key (no dots) never reaches the regex engine on the request path.
    return credential.count(".") == 2 and _JWT_SHAPE.fullmatch(credential) is not None


class TokenRejected(Exception):
    """A token that must not authenticate; the message is safe to return to the client."""


@dataclass(frozen=True)
class VerificationKey:
    alg: str  # the only algorithm this key may verify
    key: Any  # bytes for HS256, a cryptography public key for ES256/RS256
    kid: str | None = None


class PublicKeyEntry(Section):
    """One `auth.jwt.public_keys` entry: a PEM public key (inline or a file) and its algorithm."""

    alg: Literal["ES256", "RS256"]
    pem: StrictStr | None = None
    pem_file: NonEmptyStr | None = Field(default=None, description="read when auth starts")
    kid: NonEmptyStr | None = None

    @model_validator(mode="after")
    def _one_pem_that_fits_alg(self) -> PublicKeyEntry:
        if (self.pem is None) == (self.pem_file is None):
            raise problem("give exactly one of pem or pem_file")
        if self.pem is not None:
            try:
                load_public_key(self.alg, self.pem.encode("utf-8"))
            except ValueError as exc:
                raise problem(str(exc), "pem") from None
        return self


class JwtSection(Section):
    """`auth.jwt` as written. An environment variable (`hs256_secret_env`) and a `pem_file` are
    read when auth starts (`JwtSettings.from_section`), in the process that serves it."""

    issuer: NonEmptyStr
    audience: NonEmptyStr
    leeway_s: Annotated[Float, Field(ge=0)] = 30.0
    hs256_secret: SecretStr | None = None
    hs256_secret_env: NonEmptyStr | None = None
    public_keys: Items[PublicKeyEntry] = ()
    tenant_claim: NonEmptyStr = "tenant"
    scopes_claim: NonEmptyStr = "scope"

    @field_validator("hs256_secret")
    @classmethod
    def _secret_is_strong(cls, secret: SecretStr | None) -> SecretStr | None:
        if secret is not None:
            trouble = hs256_secret_problem(secret.get_secret_value().encode("utf-8"))
            if trouble:
                raise problem(trouble)
        return secret

    @field_validator("public_keys")
    @classmethod
    def _kids_are_unique(cls, keys: tuple[PublicKeyEntry, ...]) -> tuple[PublicKeyEntry, ...]:
        seen: set[str] = set()
        for i, key in enumerate(keys):
            if key.kid is not None:
                if key.kid in seen:
                    raise problem(f"duplicate key id {key.kid!r}", i, "kid")
                seen.add(key.kid)
        return keys

    @model_validator(mode="after")
    def _some_key(self) -> JwtSection:
        if self.hs256_secret is not None and self.hs256_secret_env is not None:
            raise problem("give one of hs256_secret or hs256_secret_env, not both")
        if self.hs256_secret is None and self.hs256_secret_env is None and not self.public_keys:
            raise problem("no verification key; give hs256_secret, hs256_secret_env or public_keys")
        return self


@dataclass(frozen=True)
class JwtSettings:
    issuer: str
    audience: str
    leeway_s: float
    keys: tuple[VerificationKey, ...]
    tenant_claim: str = "tenant"
    scopes_claim: str = "scope"

    @property
    def algorithms(self) -> tuple[str, ...]:
        return tuple(sorted({k.alg for k in self.keys}))

    @classmethod
    def from_section(
        cls, section: JwtSection, where: str = "auth.jwt", environ: Mapping[str, str] | None = None
    ) -> JwtSettings:
        """Settings with every key loaded; reads `hs256_secret_env` from `environ` (default
        os.environ) and `pem_file`s, the two things a config check cannot see."""
        keys: list[VerificationKey] = []
        secret = _hs256_secret(section, where, os.environ if environ is None else environ)
        if secret is not None:
            keys.append(VerificationKey("HS256", secret))
        for i, entry in enumerate(section.public_keys):
            keys.append(_public_key(entry, f"{where}.public_keys[{i}]"))
        return cls(issuer=section.issuer, audience=section.audience, leeway_s=section.leeway_s, keys=tuple(keys),
                   tenant_claim=section.tenant_claim, scopes_claim=section.scopes_claim)


def hs256_secret_problem(secret: bytes) -> str | None:
    """What makes `secret` unfit to be an HMAC key, or None. Its length is told, never the secret."""
    if len(secret) < MIN_HS256_SECRET_BYTES:
        return f"must be at least {MIN_HS256_SECRET_BYTES} bytes, got {len(secret)}"
    try:
        HMACAlgorithm(HMACAlgorithm.SHA256).prepare_key(secret)
    except jwt.InvalidKeyError:
        return "looks like a PEM/SSH key, not an HMAC secret"
    return None


def _hs256_secret(section: JwtSection, where: str, environ: Mapping[str, str]) -> bytes | None:
    if section.hs256_secret is not None:
        return section.hs256_secret.get_secret_value().encode("utf-8")
    name = section.hs256_secret_env
    if name is None:
        return None
    field = f"{where}.hs256_secret_env"
    value = environ.get(name, "")
    if not value:
        raise ConfigError(f"{field}: environment variable {name!r} is not set or empty")
    secret = value.encode("utf-8")
    trouble = hs256_secret_problem(secret)
    if trouble:
        raise ConfigError(f"{field}: {trouble}")
    return secret


def load_public_key(alg: str, data: bytes) -> Any:
    """The public key in PEM `data`, if it fits `alg`; ValueError says why not."""
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError):
        raise ValueError("does not parse as a PEM public key") from None
    if alg == "ES256" and not (isinstance(key, ec.EllipticCurvePublicKey) and key.curve.name == "secp256r1"):
        raise ValueError("ES256 needs a P-256 (secp256r1) EC public key")
    if alg == "RS256":
        if not isinstance(key, rsa.RSAPublicKey):
            raise ValueError("RS256 needs an RSA public key")
        if key.key_size < MIN_RSA_BITS:
            raise ValueError(f"RSA key has {key.key_size} bits; at least {MIN_RSA_BITS} required")
    return key


def _public_key(entry: PublicKeyEntry, where: str) -> VerificationKey:
    if entry.pem_file is not None:
        field = f"{where}.pem_file"
        try:
            data = Path(entry.pem_file).read_bytes()
        except OSError as exc:
            raise ConfigError(f"{field}: cannot read {entry.pem_file!r}: {exc.strerror}") from exc
    else:
        field, data = f"{where}.pem", (entry.pem or "").encode("utf-8")
    try:
        return VerificationKey(entry.alg, load_public_key(entry.alg, data), entry.kid)
    except ValueError as exc:
        raise ConfigError(f"{field}: {exc}") from None


@dataclass(frozen=True)
class VerifiedToken:
    tenant: str
    scopes: tuple[str, ...]
    subject: str
    max_priority: int
    expires_at: float


_PYJWT_OPTIONS: Any = {
    "verify_exp": False,  # checked below against the injected clock
    "verify_nbf": False,
    "verify_iat": False,
    "require": ["exp", "iss", "aud"],
}


class JwtVerifier:
    """Checks signature, issuer, audience and time of a token; returns what it says."""

    def __init__(self, settings: JwtSettings, clock: Clock) -> None:
        self.settings = settings
        self._clock = clock

    def verify(self, token: str) -> VerifiedToken:
        header = _header(token)
        alg = header.get("alg")
        candidates = [k for k in self.settings.keys if k.alg == alg]
        if not candidates:
            named = f" {alg!r}" if isinstance(alg, str) and alg in _JWS_NAMES else ""
            raise TokenRejected(
                f"token algorithm{named} not accepted; accepted: {', '.join(self.settings.algorithms)}"
            )
        kid = header.get("kid")
        by_kid = [k for k in candidates if k.kid is not None and k.kid == kid]
        payload = self._decode(token, by_kid or candidates)
        self._check_time(payload)
        return self._principal(payload)

    def _decode(self, token: str, keys: list[VerificationKey]) -> dict[str, Any]:
        s = self.settings
        for key in keys:
            try:
                return jwt.decode(
                    token, key.key, algorithms=[key.alg], audience=s.audience, issuer=s.issuer,
                    options=_PYJWT_OPTIONS,
                )
            except jwt.InvalidSignatureError:
                continue  # another key of the same algorithm may have signed it
            except jwt.MissingRequiredClaimError as exc:
                raise TokenRejected(f"token has no {exc.claim!r} claim") from None
            except jwt.InvalidIssuerError:
                raise TokenRejected("issuer mismatch") from None
            except jwt.InvalidAudienceError:
                raise TokenRejected("audience mismatch") from None
            except jwt.DecodeError:
                raise TokenRejected("malformed token") from None
            except jwt.PyJWTError:
                raise TokenRejected("token could not be verified") from None
        raise TokenRejected("invalid signature")

    def _check_time(self, payload: Mapping[str, Any]) -> None:
        now, leeway = self._clock(), self.settings.leeway_s
        if now > _time_claim(payload, "exp") + leeway:
            raise TokenRejected("token expired")
        if "nbf" in payload and now + leeway < _time_claim(payload, "nbf"):
            raise TokenRejected("token not yet valid (nbf is in the future)")

    def _principal(self, payload: Mapping[str, Any]) -> VerifiedToken:
        claim = self.settings.tenant_claim
        tenant = payload.get(claim)
        if not isinstance(tenant, str) or not tenant:
            raise TokenRejected(f"token has no tenant claim {claim!r}")
        subject = payload.get("sub", "")
        if not isinstance(subject, str):
            raise TokenRejected("claim 'sub' must be a string")
        priority = payload.get("max_priority", 0)
        if isinstance(priority, bool) or not isinstance(priority, int) or priority < 0:
            raise TokenRejected("claim 'max_priority' must be an integer >= 0")
        return VerifiedToken(
            tenant, self._scopes(payload), subject, priority, _time_claim(payload, "exp")
        )

    def _scopes(self, payload: Mapping[str, Any]) -> tuple[str, ...]:
        claim = self.settings.scopes_claim
        value = payload.get(claim)
        if value is None:
            return ()
        if isinstance(value, str):
            return tuple(value.split())
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise TokenRejected(f"claim {claim!r} must be a space-separated string or a list of strings")


def _header(token: str) -> Mapping[str, Any]:
    try:
        header = jwt.get_unverified_header(token)
    except jwt.PyJWTError:
        raise TokenRejected("malformed token") from None
    return header if isinstance(header, Mapping) else {}


def _time_claim(payload: Mapping[str, Any], name: str) -> float:
    value = payload.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TokenRejected(f"claim {name!r} must be a number (unix seconds)")
    return float(value)
