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
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import HMACAlgorithm

from services.auth_keys import entry_list, expect_fields, required_text
from services.common import Clock, ConfigError, number

# Three dot-separated base64url parts; the signature may be empty (`alg: none`), so that such
# a token is still treated as a JWT and refused as one rather than as an unknown API key.
_JWT_SHAPE = re.compile(r"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*")
_JWT_FIELDS = (
    "issuer", "audience", "leeway_s", "hs256_secret", "hs256_secret_env",
    "public_keys", "tenant_claim", "scopes_claim",
)
_PUBLIC_KEY_FIELDS = ("alg", "pem", "pem_file", "kid")
_PUBLIC_ALGS = ("ES256", "RS256")
# Registered JWS names: safe to quote back in a message, unlike anything else from a header.
_JWS_NAMES = frozenset({
    "none", "HS256", "HS384", "HS512", "RS256", "RS384", "RS512",
    "ES256", "ES256K", "ES384", "ES512", "PS256", "PS384", "PS512", "EdDSA",
})
MIN_HS256_SECRET_BYTES = 32
MIN_RSA_BITS = 2048


def looks_like_jwt(credential: str) -> bool:
    return _JWT_SHAPE.fullmatch(credential) is not None


class TokenRejected(Exception):
    """A token that must not authenticate; the message is safe to return to the client."""


@dataclass(frozen=True)
class VerificationKey:
    alg: str  # the only algorithm this key may verify
    key: Any  # bytes for HS256, a cryptography public key for ES256/RS256
    kid: str | None = None


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
    def from_dict(
        cls, cfg: Mapping[str, Any], where: str = "auth.jwt", environ: Mapping[str, str] | None = None
    ) -> JwtSettings:
        expect_fields(cfg, _JWT_FIELDS, where)
        keys: list[VerificationKey] = []
        secret = _hs256_secret(cfg, where, os.environ if environ is None else environ)
        if secret is not None:
            keys.append(VerificationKey("HS256", secret))
        seen_kids: set[str] = set()
        for i, entry in enumerate(entry_list(cfg, "public_keys", where)):
            key = _public_key(entry, f"{where}.public_keys[{i}]")
            if key.kid is not None:
                if key.kid in seen_kids:
                    raise ConfigError(f"{where}.public_keys[{i}].kid: duplicate key id {key.kid!r}")
                seen_kids.add(key.kid)
            keys.append(key)
        if not keys:
            raise ConfigError(f"{where}: no verification key; give hs256_secret, hs256_secret_env or public_keys")
        return cls(
            issuer=required_text(cfg, "issuer", where),
            audience=required_text(cfg, "audience", where),
            leeway_s=number(cfg, "leeway_s", 30.0, where=where),
            keys=tuple(keys),
            tenant_claim=required_text({"tenant_claim": "tenant", **cfg}, "tenant_claim", where),
            scopes_claim=required_text({"scopes_claim": "scope", **cfg}, "scopes_claim", where),
        )


def _hs256_secret(cfg: Mapping[str, Any], where: str, environ: Mapping[str, str]) -> bytes | None:
    inline, env_name = cfg.get("hs256_secret"), cfg.get("hs256_secret_env")
    if inline is not None and env_name is not None:
        raise ConfigError(f"{where}: give one of hs256_secret or hs256_secret_env, not both")
    if inline is None and env_name is None:
        return None
    if env_name is not None:
        if not isinstance(env_name, str) or not env_name:
            raise ConfigError(f"{where}.hs256_secret_env: expected an environment variable name, got {env_name!r}")
        field, value = f"{where}.hs256_secret_env", environ.get(env_name, "")
        if not value:
            raise ConfigError(f"{field}: environment variable {env_name!r} is not set or empty")
    else:
        field = f"{where}.hs256_secret"
        if not isinstance(inline, str):
            raise ConfigError(f"{field}: expected a string, got {type(inline).__name__}")
        value = inline
    secret = value.encode("utf-8")
    # The secret's length is reported, never the secret.
    if len(secret) < MIN_HS256_SECRET_BYTES:
        raise ConfigError(f"{field}: must be at least {MIN_HS256_SECRET_BYTES} bytes, got {len(secret)}")
    try:
        HMACAlgorithm(HMACAlgorithm.SHA256).prepare_key(secret)
    except jwt.InvalidKeyError as exc:
        raise ConfigError(f"{field}: looks like a PEM/SSH key, not an HMAC secret") from exc
    return secret


def _public_key(cfg: Mapping[str, Any], where: str) -> VerificationKey:
    expect_fields(cfg, _PUBLIC_KEY_FIELDS, where)
    alg = cfg.get("alg")
    if alg not in _PUBLIC_ALGS:
        raise ConfigError(f"{where}.alg: unknown algorithm {alg!r}; expected one of {', '.join(_PUBLIC_ALGS)}")
    kid = cfg.get("kid")
    if kid is not None and (not isinstance(kid, str) or not kid):
        raise ConfigError(f"{where}.kid: expected a non-empty string, got {kid!r}")
    pem, pem_file = cfg.get("pem"), cfg.get("pem_file")
    if (pem is None) == (pem_file is None):
        raise ConfigError(f"{where}: give exactly one of pem or pem_file")
    if pem_file is not None:
        field = f"{where}.pem_file"
        try:
            data = Path(str(pem_file)).read_bytes()
        except OSError as exc:
            raise ConfigError(f"{field}: cannot read {pem_file!r}: {exc.strerror}") from exc
    else:
        field = f"{where}.pem"
        data = pem.encode("utf-8") if isinstance(pem, str) else b""
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{field}: does not parse as a PEM public key") from exc
    if alg == "ES256" and not (isinstance(key, ec.EllipticCurvePublicKey) and key.curve.name == "secp256r1"):
        raise ConfigError(f"{field}: ES256 needs a P-256 (secp256r1) EC public key")
    if alg == "RS256":
        if not isinstance(key, rsa.RSAPublicKey):
            raise ConfigError(f"{field}: RS256 needs an RSA public key")
        if key.key_size < MIN_RSA_BITS:
            raise ConfigError(f"{field}: RSA key has {key.key_size} bits; at least {MIN_RSA_BITS} required")
    return VerificationKey(alg, key, kid)


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
