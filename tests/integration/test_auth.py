"""The Auth service: API keys and JWTs, through a real gRPC server and through `verify`."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from services.auth.config import AuthConfig
from services.auth.service import AuthDenied, AuthService
from tests.batch_of_one import one
from tests.conftest import served
from wire.v1 import auth_pb2, auth_pb2_grpc

NOW = 1_700_000_000.0
ISSUER, AUDIENCE = "spine-test", "spine"
HS_SECRET = "test-hs256-secret-that-is-long-enough-0123456789"
DEV_KEY = "sk-test-plaintext-key-0001"
HASHED_KEY = "sk-test-hashed-only-key-0002"
UNAUTH, DENIED = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED


class FakeClock:
    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def public_pem(private_key: Any) -> str:
    return private_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode()


def auth_section(ec_key: Any, rsa_key: Any, **jwt_overrides: Any) -> dict[str, Any]:
    return {
        "api_keys": [
            {"id": "dev-key", "tenant": "dev", "key": DEV_KEY, "scopes": ["generate"], "max_priority": 1},
            {
                "id": "ops-key", "tenant": "ops", "scopes": ["generate", "admin"], "max_priority": 3,
                "key_sha256": hashlib.sha256(HASHED_KEY.encode()).hexdigest(),
            },
            {"id": "read-key", "tenant": "readers", "key": "sk-test-read-only-0003", "scopes": ["read"]},
        ],
        "jwt": {
            "issuer": ISSUER,
            "audience": AUDIENCE,
            "leeway_s": 30,
            "hs256_secret": HS_SECRET,
            "public_keys": [{"alg": "ES256", "pem": public_pem(ec_key)}, {"alg": "RS256", "pem": public_pem(rsa_key)}],
            "tenant_claim": "tenant",
            "scopes_claim": "scope",
            **jwt_overrides,
        },
    }


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def service(ec_key: Any, rsa_key: Any, clock: FakeClock) -> AuthService:
    return AuthService(AuthConfig.parse(auth_section(ec_key, rsa_key)), clock=clock)


@pytest.fixture
def stub(service: AuthService) -> Iterator[auth_pb2_grpc.AuthStub]:
    with served("auth", service) as auth_stub:
        yield auth_stub


def claims(**overrides: Any) -> dict[str, Any]:
    base = {
        "iss": ISSUER, "aud": AUDIENCE, "sub": "user-7", "tenant": "acme",
        "scope": "generate read", "exp": int(NOW) + 600, "iat": int(NOW),
    }
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not None}


def hs256(**overrides: Any) -> str:
    return jwt.encode(claims(**overrides), HS_SECRET, algorithm="HS256")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def handmade_token(header: dict[str, Any], payload: dict[str, Any], sign: Any) -> str:
    """A token built without PyJWT, for the forgeries PyJWT refuses to produce."""
    signing_input = f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(payload).encode())}"
    return f"{signing_input}.{_b64(sign(signing_input.encode()))}"


def check(stub: auth_pb2_grpc.AuthStub, credential: str) -> auth_pb2.CheckResponse:
    return one(stub.CheckBatch(auth_pb2.CheckBatchRequest(items=[auth_pb2.CheckRequest(credential=credential)]),
                               timeout=10))


@dataclass(frozen=True)
class Denial:
    code: grpc.StatusCode
    details: str


def denial(stub: auth_pb2_grpc.AuthStub, credential: str) -> Denial:
    with pytest.raises(grpc.RpcError) as info:
        check(stub, credential)
    return Denial(info.value.code(), info.value.details() or "")


# --- API keys ------------------------------------------------------------------------------


def test_valid_api_key_yields_its_tenant_scopes_and_priority(stub: auth_pb2_grpc.AuthStub) -> None:
    response = check(stub, DEV_KEY)
    assert response.method == "api_key"
    assert response.principal.tenant == "dev"
    assert response.principal.subject == "dev-key"
    assert list(response.principal.scopes) == ["generate"]
    assert response.principal.max_priority == 1
    assert response.expires_at == 0.0


def test_unknown_api_key_is_unauthenticated(stub: auth_pb2_grpc.AuthStub) -> None:
    error = denial(stub, "sk-not-a-configured-key")
    assert error.code == UNAUTH
    assert error.details == "unknown API key"


def test_key_configured_only_by_sha256_authenticates(stub: auth_pb2_grpc.AuthStub) -> None:
    response = check(stub, HASHED_KEY)
    assert (response.principal.tenant, response.principal.max_priority) == ("ops", 3)


def test_plaintext_key_is_not_kept_in_memory(service: AuthService) -> None:
    held = repr(vars(service.keys)) + repr(vars(service))
    assert DEV_KEY not in held
    assert DEV_KEY.encode() not in held.encode()


def test_key_without_generate_scope_is_permission_denied(stub: auth_pb2_grpc.AuthStub) -> None:
    error = denial(stub, "sk-test-read-only-0003")
    assert error.code == DENIED
    assert "'generate'" in error.details and "readers" in error.details


def test_missing_credential_is_unauthenticated(stub: auth_pb2_grpc.AuthStub) -> None:
    error = denial(stub, "")
    assert (error.code, error.details) == (UNAUTH, "missing credential")


def test_bearer_prefix_is_accepted(service: AuthService) -> None:
    assert service.verify(f"Bearer {DEV_KEY}").principal.tenant == "dev"


# --- JWTs ----------------------------------------------------------------------------------


def test_hs256_token_yields_its_claims(stub: auth_pb2_grpc.AuthStub) -> None:
    response = check(stub, hs256())
    assert response.method == "jwt"
    assert response.principal.tenant == "acme"
    assert response.principal.subject == "user-7"
    assert list(response.principal.scopes) == ["generate", "read"]
    assert response.principal.max_priority == 0
    assert response.expires_at == NOW + 600


def test_es256_token_is_accepted(stub: auth_pb2_grpc.AuthStub, ec_key: Any) -> None:
    token = jwt.encode(claims(tenant="es-tenant"), ec_key, algorithm="ES256")
    assert check(stub, token).principal.tenant == "es-tenant"


def test_rs256_token_with_scope_list_and_priority_is_accepted(stub: auth_pb2_grpc.AuthStub, rsa_key: Any) -> None:
    token = jwt.encode(claims(scope=["generate", "x"], max_priority=2), rsa_key, algorithm="RS256")
    response = check(stub, token)
    assert list(response.principal.scopes) == ["generate", "x"]
    assert response.principal.max_priority == 2


def test_token_signed_by_any_configured_key_of_its_algorithm_is_accepted(ec_key: Any, rsa_key: Any) -> None:
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    section = auth_section(ec_key, rsa_key)
    section["jwt"]["public_keys"].append({"alg": "RS256", "pem": public_pem(other), "kid": "next"})
    service = AuthService(AuthConfig.parse(section), clock=FakeClock())
    assert service.verify(jwt.encode(claims(), other, algorithm="RS256")).principal.tenant == "acme"
    by_kid = jwt.encode(claims(), other, algorithm="RS256", headers={"kid": "next"})
    assert service.verify(by_kid).principal.tenant == "acme"


def test_token_expired_beyond_leeway_is_unauthenticated(stub: auth_pb2_grpc.AuthStub) -> None:
    error = denial(stub, hs256(exp=int(NOW) - 31))
    assert (error.code, error.details) == (UNAUTH, "token expired")


def test_token_expired_within_leeway_is_accepted(stub: auth_pb2_grpc.AuthStub) -> None:
    assert check(stub, hs256(exp=int(NOW) - 29)).principal.tenant == "acme"


def test_token_with_future_nbf_is_unauthenticated(stub: auth_pb2_grpc.AuthStub) -> None:
    error = denial(stub, hs256(nbf=int(NOW) + 60))
    assert error.code == UNAUTH
    assert "not yet valid" in error.details


def test_token_from_another_issuer_is_unauthenticated(stub: auth_pb2_grpc.AuthStub) -> None:
    error = denial(stub, hs256(iss="someone-else"))
    assert (error.code, error.details) == (UNAUTH, "issuer mismatch")


def test_token_for_another_audience_is_unauthenticated(stub: auth_pb2_grpc.AuthStub) -> None:
    error = denial(stub, hs256(aud="another-service"))
    assert (error.code, error.details) == (UNAUTH, "audience mismatch")


@pytest.mark.parametrize("claim", ["exp", "iss", "aud"])
def test_token_missing_a_required_claim_is_unauthenticated(stub: auth_pb2_grpc.AuthStub, claim: str) -> None:
    error = denial(stub, hs256(**{claim: None}))
    assert error.code == UNAUTH
    assert f"'{claim}'" in error.details


def test_alg_none_token_is_unauthenticated(stub: auth_pb2_grpc.AuthStub) -> None:
    token = handmade_token({"alg": "none", "typ": "JWT"}, claims(), lambda _: b"")
    error = denial(stub, token)
    assert error.code == UNAUTH
    assert "'none' not accepted" in error.details


def test_hs256_token_signed_with_a_public_key_pem_is_unauthenticated(
    stub: auth_pb2_grpc.AuthStub, rsa_key: Any
) -> None:
    """Algorithm confusion: the public PEM used as an HMAC secret must never verify."""
    pem = public_pem(rsa_key).encode()
    token = handmade_token(
        {"alg": "HS256", "typ": "JWT"}, claims(), lambda data: hmac.new(pem, data, hashlib.sha256).digest()
    )
    error = denial(stub, token)
    assert (error.code, error.details) == (UNAUTH, "invalid signature")


def test_hs256_token_is_refused_when_only_public_keys_are_configured(ec_key: Any, rsa_key: Any) -> None:
    section = auth_section(ec_key, rsa_key, hs256_secret=None)
    service = AuthService(AuthConfig.parse(section), clock=FakeClock())
    pem = public_pem(rsa_key).encode()
    token = handmade_token(
        {"alg": "HS256", "typ": "JWT"}, claims(), lambda data: hmac.new(pem, data, hashlib.sha256).digest()
    )
    with pytest.raises(AuthDenied) as info:
        service.verify(token)
    assert info.value.code == UNAUTH
    assert info.value.message == "token algorithm 'HS256' not accepted; accepted: ES256, RS256"


def test_tampered_signature_is_unauthenticated(stub: auth_pb2_grpc.AuthStub, ec_key: Any) -> None:
    for token in (hs256(), jwt.encode(claims(), ec_key, algorithm="ES256")):
        head, body, sig = token.split(".")
        flipped = sig[:10] + ("A" if sig[10] != "A" else "B") + sig[11:]
        error = denial(stub, f"{head}.{body}.{flipped}")
        assert (error.code, error.details) == (UNAUTH, "invalid signature")


def test_tampered_payload_is_unauthenticated(stub: auth_pb2_grpc.AuthStub) -> None:
    head, _, sig = hs256().split(".")
    forged_body = _b64(json.dumps(claims(tenant="victim")).encode())
    error = denial(stub, f"{head}.{forged_body}.{sig}")
    assert (error.code, error.details) == (UNAUTH, "invalid signature")


def test_token_without_tenant_claim_is_unauthenticated(stub: auth_pb2_grpc.AuthStub) -> None:
    error = denial(stub, hs256(tenant=None))
    assert error.code == UNAUTH
    assert "tenant" in error.details


def test_token_without_generate_scope_is_permission_denied(stub: auth_pb2_grpc.AuthStub) -> None:
    error = denial(stub, hs256(scope="read"))
    assert error.code == DENIED


def test_garbage_shaped_like_a_jwt_is_unauthenticated(stub: auth_pb2_grpc.AuthStub) -> None:
    error = denial(stub, "aaaa.bbbb.cccc")
    assert (error.code, error.details) == (UNAUTH, "malformed token")


def test_jwt_is_refused_when_jwt_is_not_configured(ec_key: Any, rsa_key: Any) -> None:
    section = auth_section(ec_key, rsa_key)
    del section["jwt"]
    service = AuthService(AuthConfig.parse(section), clock=FakeClock())
    with pytest.raises(AuthDenied) as info:
        service.verify(hs256())
    assert info.value.code == UNAUTH
    assert service.verify(DEV_KEY).principal.tenant == "dev"


def test_no_denial_message_quotes_the_credential_or_a_secret(
    stub: auth_pb2_grpc.AuthStub, rsa_key: Any
) -> None:
    pem = public_pem(rsa_key).encode()
    credentials = [
        "sk-unknown-key-with-a-distinctive-tail-XYZZY",
        "sk-test-read-only-0003",
        hs256(exp=int(NOW) - 100),
        hs256(iss="evil"),
        hs256(aud="evil"),
        hs256(tenant=None),
        hs256(scope="read"),
        hs256(nbf=int(NOW) + 100),
        handmade_token({"alg": "none"}, claims(), lambda _: b""),
        handmade_token({"alg": "HS256"}, claims(), lambda d: hmac.new(pem, d, hashlib.sha256).digest()),
        "eyJhbGciOiJIUzI1NiJ9.not-json-at-all.c2lnbmF0dXJl",
    ]
    for credential in credentials:
        details = denial(stub, credential).details
        assert credential not in details
        assert all(part not in details for part in credential.split(".") if len(part) > 4)
        assert HS_SECRET not in details


def check_batch(service: AuthService, credentials: list[str]) -> list[auth_pb2.CheckResult]:
    request = auth_pb2.CheckBatchRequest(items=[auth_pb2.CheckRequest(credential=c) for c in credentials])
    return list(service.CheckBatch(request).results)


def test_check_batch_returns_one_result_per_credential_in_order(service: AuthService) -> None:
    ok, denied, jwt_ok = check_batch(service, [DEV_KEY, "nope", hs256()])
    assert ok.status.code == 0 and ok.response.principal.tenant == "dev"
    assert denied.status.code == UNAUTH.value[0] and denied.status.message == "unknown API key"
    assert jwt_ok.status.code == 0 and jwt_ok.response.principal.tenant == "acme"


def test_a_credential_repeated_in_a_batch_is_verified_once_with_the_one_by_one_verdict(
        service: AuthService) -> None:
    token = hs256()
    batch = [DEV_KEY, "nope", token, DEV_KEY, "nope", token, DEV_KEY]
    calls: list[str] = []
    verdict = service._verdict

    def counting(credential: str) -> Any:
        calls.append(credential)
        return verdict(credential)

    service._verdict = counting  # type: ignore[method-assign]
    results = check_batch(service, batch)
    assert sorted(calls) == sorted({DEV_KEY, "nope", token})
    one_by_one = [check_batch(service, [credential])[0] for credential in batch]
    assert results == one_by_one


# --- the verification cache ----------------------------------------------------------------


def test_repeat_token_is_served_from_the_cache(service: AuthService) -> None:
    token = hs256()
    first = service.verify(token)
    second = service.verify(token)
    assert (service.cache.hits, service.cache.misses) == (1, 1)
    assert second == first


def test_cached_verdict_is_not_honoured_after_the_token_expires(service: AuthService, clock: FakeClock) -> None:
    token = hs256(exp=int(NOW) + 60)
    service.verify(token)
    clock.now = NOW + 61  # past exp, still within the 30 s leeway: re-verified, not served
    assert service.verify(token).principal.tenant == "acme"
    assert service.cache.hits == 0
    clock.now = NOW + 91  # past exp + leeway
    with pytest.raises(AuthDenied) as info:
        service.verify(token)
    assert info.value.message == "token expired"
    assert service.cache.hits == 0


def test_mutating_a_returned_response_does_not_change_the_cached_one(service: AuthService) -> None:
    token = hs256()
    service.verify(token).principal.tenant = "tampered"
    assert service.verify(token).principal.tenant == "acme"


def test_denial_is_cached_only_for_a_few_seconds(service: AuthService, clock: FakeClock) -> None:
    token = hs256(nbf=int(NOW) + 31)  # valid from NOW + 1 given the 30 s leeway
    with pytest.raises(AuthDenied):
        service.verify(token)
    clock.now = NOW + 1.5  # now valid, but the denial is still cached
    with pytest.raises(AuthDenied):
        service.verify(token)
    assert service.cache.hits == 1
    clock.now = NOW + 2.5  # the cached denial has lapsed
    assert service.verify(token).principal.tenant == "acme"


def test_cache_is_bounded_and_evicts_the_least_recently_used(ec_key: Any, rsa_key: Any) -> None:
    section = auth_section(ec_key, rsa_key)
    section["cache"] = {"max_entries": 2}
    service = AuthService(AuthConfig.parse(section), clock=FakeClock())
    a, b, c = hs256(sub="a"), hs256(sub="b"), hs256(sub="c")
    service.verify(a)
    service.verify(b)
    service.verify(a)  # a is now the most recently used
    service.verify(c)  # evicts b
    assert len(service.cache) == 2
    hits = service.cache.hits
    service.verify(a)
    assert service.cache.hits == hits + 1
    service.verify(b)
    assert service.cache.hits == hits + 1
