"""The Auth service's configuration: what is refused at load, and how, without leaking a secret."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from services.auth.config import AuthConfig
from services.auth.service import AuthService
from services.common import ConfigError
from tests.integration.test_auth import DEV_KEY, HS_SECRET, FakeClock, auth_section, hs256, public_pem


def test_default_config_auth_section_parses_and_its_dev_key_works() -> None:
    config = yaml.safe_load(Path("runtime/default_config.yaml").read_text())
    service = AuthService(AuthConfig.parse(config["auth"]))
    assert service.verify("spine-dev-key-0000").principal.tenant == "dev"


def test_hs256_secret_can_come_from_the_environment(ec_key: Any, rsa_key: Any) -> None:
    section = auth_section(ec_key, rsa_key, hs256_secret=None, hs256_secret_env="SPINE_TEST_SECRET")
    service = AuthService(AuthConfig.parse(section), clock=FakeClock(), environ={"SPINE_TEST_SECRET": HS_SECRET})
    assert service.verify(hs256()).principal.tenant == "acme"


def _config_error(section: dict[str, Any], environ: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        AuthService(AuthConfig.parse(section), environ=environ or {})
    return str(info.value)


def test_short_hs256_secret_is_a_config_error_that_hides_the_secret(ec_key: Any, rsa_key: Any) -> None:
    message = _config_error(auth_section(ec_key, rsa_key, hs256_secret="too-short-secret"))
    assert message.startswith("auth.jwt.hs256_secret:")
    assert "at least 32 bytes, got 16" in message
    assert "too-short-secret" not in message


def test_empty_hs256_secret_is_a_config_error(ec_key: Any, rsa_key: Any) -> None:
    assert _config_error(auth_section(ec_key, rsa_key, hs256_secret="")).startswith("auth.jwt.hs256_secret:")


def test_unset_secret_environment_variable_is_a_config_error(ec_key: Any, rsa_key: Any) -> None:
    section = auth_section(ec_key, rsa_key, hs256_secret=None, hs256_secret_env="SPINE_MISSING")
    message = _config_error(section)
    assert message.startswith("auth.jwt.hs256_secret_env:") and "'SPINE_MISSING'" in message


def test_pem_that_does_not_parse_is_a_config_error(ec_key: Any, rsa_key: Any) -> None:
    bad = [{"alg": "ES256", "pem": "-----BEGIN PUBLIC KEY-----\nnot base64\n-----END PUBLIC KEY-----\n"}]
    message = _config_error(auth_section(ec_key, rsa_key, public_keys=bad))
    assert message == "auth.jwt.public_keys[0].pem: does not parse as a PEM public key"


def test_pem_of_the_wrong_key_type_is_a_config_error(ec_key: Any, rsa_key: Any) -> None:
    swapped = [{"alg": "ES256", "pem": public_pem(rsa_key)}]
    assert "P-256" in _config_error(auth_section(ec_key, rsa_key, public_keys=swapped))


def test_unreadable_pem_file_is_a_config_error(ec_key: Any, rsa_key: Any) -> None:
    missing = [{"alg": "RS256", "pem_file": "/nonexistent/spine.pub"}]
    message = _config_error(auth_section(ec_key, rsa_key, public_keys=missing))
    assert message.startswith("auth.jwt.public_keys[0].pem_file:") and "/nonexistent/spine.pub" in message


def test_unknown_algorithm_is_a_config_error(ec_key: Any, rsa_key: Any) -> None:
    keys = [{"alg": "HS512", "pem": public_pem(ec_key)}]
    message = _config_error(auth_section(ec_key, rsa_key, public_keys=keys))
    assert message == "auth.jwt.public_keys[0].alg: Input should be 'ES256' or 'RS256', got 'HS512'"


def test_duplicate_api_key_id_is_a_config_error(ec_key: Any, rsa_key: Any) -> None:
    section = auth_section(ec_key, rsa_key)
    section["api_keys"].append({"id": "dev-key", "tenant": "x", "key": "sk-another-key-entirely"})
    assert _config_error(section) == "auth.api_keys[3].id: duplicate key id 'dev-key'"


def test_same_key_under_two_ids_is_a_config_error_that_hides_the_key(ec_key: Any, rsa_key: Any) -> None:
    section = auth_section(ec_key, rsa_key)
    section["api_keys"].append({"id": "copy", "tenant": "x", "key": DEV_KEY})
    message = _config_error(section)
    assert "'dev-key'" in message and DEV_KEY not in message


def test_duplicate_public_key_kid_is_a_config_error(ec_key: Any, rsa_key: Any) -> None:
    keys = [{"alg": "ES256", "pem": public_pem(ec_key), "kid": "k1"}, {"alg": "RS256", "pem": public_pem(rsa_key), "kid": "k1"}]
    assert _config_error(auth_section(ec_key, rsa_key, public_keys=keys)).startswith("auth.jwt.public_keys[1].kid:")


def test_key_with_both_plaintext_and_hash_is_a_config_error(ec_key: Any, rsa_key: Any) -> None:
    section = auth_section(ec_key, rsa_key)
    section["api_keys"][0]["key_sha256"] = "0" * 64
    assert _config_error(section).startswith("auth.api_keys[0]: give exactly one of")


def test_malformed_key_hash_is_a_config_error(ec_key: Any, rsa_key: Any) -> None:
    section = auth_section(ec_key, rsa_key)
    section["api_keys"][1]["key_sha256"] = "abc"
    assert _config_error(section).startswith("auth.api_keys[1].key_sha256:")


def test_misspelled_field_is_a_config_error(ec_key: Any, rsa_key: Any) -> None:
    section = auth_section(ec_key, rsa_key)
    section["api_keys"][0]["scope"] = ["generate"]
    assert _config_error(section).startswith("auth.api_keys[0].scope: unknown key; known: id, tenant, key")


def test_jwt_section_without_any_key_is_a_config_error(ec_key: Any, rsa_key: Any) -> None:
    message = _config_error(auth_section(ec_key, rsa_key, hs256_secret=None, public_keys=[]))
    assert message.startswith("auth.jwt: no verification key")


def test_jwt_section_without_issuer_is_a_config_error(ec_key: Any, rsa_key: Any) -> None:
    assert _config_error(auth_section(ec_key, rsa_key, issuer="")).startswith("auth.jwt.issuer:")
