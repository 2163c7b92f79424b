"""The spine as Envoy's ext_authz service: `Authorization.Check` on a collapsed spine's Envoy listener
decides like the Gateway (same keys, same JWT settings), forwards the tenant as `x-spine-tenant`
and answers every bad request with a denial, never an error."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.type.v3 import http_status_pb2

from runtime.running_stack import RunningStack
from spine.client.gateway_client import GatewayClient
from tests.conftest import (
    DEV_KEY,
    TEST_OVERRIDES,
    TIGHT_KEY,
    config_for_tests,
    make_jwt,
    start_stack,
    stop_process,
)
from tests.envoy_calls import ENVOY_LISTENER, bearer, check, envoy_address, ok_headers
from tests.waiting import eventually
from wire.v1 import generation_pb2

NO_SCOPE_KEY = "no-scope-key-0000"
CONFIG = config_for_tests(auth={"api_keys": [
    *TEST_OVERRIDES["auth"]["api_keys"],
    {"id": "reader", "tenant": "reader", "key": NO_SCOPE_KEY, "scopes": ["read"]},
]}, envoy_api=ENVOY_LISTENER)
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED.value[0]
PERMISSION_DENIED = grpc.StatusCode.PERMISSION_DENIED.value[0]


@pytest.fixture(scope="module")
def spine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    stack = start_stack("collapsed", tmp_path_factory.mktemp("envoy-authz"), CONFIG)
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def channel(spine: RunningStack) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(envoy_address(spine)) as channel:
        yield channel


def test_the_dev_key_is_allowed_with_its_tenant_forwarded_as_x_spine_tenant(channel: grpc.Channel) -> None:
    response = check(channel, bearer(DEV_KEY))
    assert response.status.code == 0 and response.HasField("ok_response")
    tenant = ok_headers(response)["x-spine-tenant"]
    assert tenant.header.value == "dev"
    assert tenant.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    metadata = response.dynamic_metadata.fields
    assert metadata["tenant"].string_value == "dev" and metadata["subject"].string_value == "dev-key"
    assert metadata["method"].string_value == "api_key" and metadata["max_priority"].number_value == 1


def test_a_jwt_is_allowed_with_the_tenant_of_its_claim(channel: grpc.Channel) -> None:
    response = check(channel, bearer(make_jwt("acme")))
    assert response.status.code == 0
    assert ok_headers(response)["x-spine-tenant"].header.value == "acme"
    assert response.dynamic_metadata.fields["method"].string_value == "jwt"


def test_a_client_cannot_choose_its_tenant_or_send_internal_headers_upstream(channel: grpc.Channel) -> None:
    headers = {**bearer(DEV_KEY), "x-spine-tenant": "tight", "x-spine-route": "spine", "x-spine-shadow": "1",
               "x-request-id": "kept"}
    response = check(channel, headers)
    assert ok_headers(response)["x-spine-tenant"].header.value == "dev"  # overwrites the client's value
    assert list(response.ok_response.headers_to_remove) == ["x-spine-route", "x-spine-shadow"]


def test_no_credential_is_a_401_with_a_bearer_challenge_and_the_reason(channel: grpc.Channel) -> None:
    response = check(channel, {"x-request-id": "r1"})
    assert response.status.code == UNAUTHENTICATED and not response.HasField("ok_response")
    assert response.denied_response.status.code == http_status_pb2.Unauthorized
    assert "missing credential" in response.denied_response.body == response.status.message
    assert {h.header.key: h.header.value for h in response.denied_response.headers} == {
        "www-authenticate": 'Bearer realm="spine"'}


@pytest.mark.parametrize(("credential", "reason"), [
    ("Bearer not-a-key-0000", "unknown api key"),
    (f"Bearer {make_jwt('acme', secret='another-secret-of-32-bytes-or-more!')}", "signature"),
    (f"Bearer {make_jwt('acme', expires_in=-3600)}", "expired"),
], ids=["unknown-key", "jwt-bad-signature", "jwt-expired"])
def test_a_bad_credential_is_a_401_naming_why(channel: grpc.Channel, credential: str, reason: str) -> None:
    response = check(channel, {"authorization": credential})
    assert response.status.code == UNAUTHENTICATED
    assert response.denied_response.status.code == http_status_pb2.Unauthorized
    assert reason in response.status.message.lower()
    assert credential.split()[-1] not in response.status.message  # never quotes the credential


def test_a_credential_without_the_required_scope_is_a_403(channel: grpc.Channel) -> None:
    response = check(channel, bearer(NO_SCOPE_KEY))
    assert response.status.code == PERMISSION_DENIED
    assert response.denied_response.status.code == http_status_pb2.Forbidden
    assert "lacks scope 'generate'" in response.status.message


@pytest.mark.parametrize(("headers", "header_map"), [
    ({"authorization": "Basic ZGV2OmRldg=="}, ()),
    ({"authorization": "Bearer"}, ()),
    ({"authorization": "Bearer    "}, ()),
    ({"authorization": DEV_KEY}, ()),  # a key without its scheme: the Gateway refuses it too
    ({"authorization": "Bearer " + "k" * 65536}, ()),
    ({}, [("authorization", f"Bearer {DEV_KEY}"), ("authorization", f"Bearer {DEV_KEY}")]),
    ({}, [("authorization", b"Bearer \xff\xfe\x00key")]),
    ({"authorization": "Bearer spine-dev-key-0000\r\nx-spine-tenant: tight"}, ()),
], ids=["basic-scheme", "empty-bearer", "blank-bearer", "no-scheme", "64k-token", "two-headers",
        "not-utf8", "header-injection"])
def test_a_malformed_authorization_header_is_a_401_and_the_service_keeps_serving(
        channel: grpc.Channel, headers: dict[str, str], header_map: list[tuple[str, str | bytes]]) -> None:
    response = check(channel, headers, header_map)
    assert response.status.code == UNAUTHENTICATED
    assert response.denied_response.status.code == http_status_pb2.Unauthorized
    assert response.status.message
    assert check(channel, bearer(DEV_KEY)).status.code == 0


def test_a_check_request_with_no_http_attributes_at_all_is_denied(channel: grpc.Channel) -> None:
    from envoy.service.auth.v3 import external_auth_pb2, external_auth_pb2_grpc

    response = external_auth_pb2_grpc.AuthorizationStub(channel).Check(external_auth_pb2.CheckRequest(), timeout=10)
    assert response.status.code == UNAUTHENTICATED


def test_the_header_map_form_is_read_like_the_headers_form(channel: grpc.Channel) -> None:
    response = check(channel, header_map=[("Authorization", f"Bearer {DEV_KEY}")])
    assert ok_headers(response)["x-spine-tenant"].header.value == "dev"


def test_a_tenant_that_cannot_be_a_header_value_is_denied_not_forwarded(channel: grpc.Channel) -> None:
    response = check(channel, bearer(make_jwt("acme\r\nx-evil: 1")))
    assert response.status.code == PERMISSION_DENIED
    assert "cannot be forwarded" in response.status.message and not response.HasField("ok_response")


def test_the_gateway_charges_the_authenticated_tenant_whatever_x_spine_tenant_says(spine: RunningStack) -> None:
    """The header is Envoy's to set for upstreams; the spine's own Gateway never reads it."""
    ratelimit = spine.local_servicers["ratelimit"]
    key = (("tenant", "tight"), ("model", "tiny-lm"), ("resource", "requests"))
    dev_key = (("tenant", "dev"), ("model", "tiny-lm"), ("resource", "requests"))
    before_tight = ratelimit.bucket(key).level if ratelimit.bucket(key) else 4.0
    before_dev = ratelimit.bucket(dev_key)
    with GatewayClient(spine.address) as client:
        result = client.generate(generation_pb2.GenerateRequest(model="tiny-lm", prompt="who pays?", max_tokens=1),
                                 token=TIGHT_KEY, headers={"x-spine-tenant": "dev"})
    assert result.ok, result.details
    assert ratelimit.bucket(key).level == pytest.approx(before_tight - 1, abs=0.01)
    assert ratelimit.bucket(dev_key) == before_dev  # dev was not charged


def test_envoy_checks_and_gateway_calls_see_the_same_keys(spine: RunningStack, channel: grpc.Channel) -> None:
    with GatewayClient(spine.address) as client:
        request = generation_pb2.GenerateRequest(model="tiny-lm", prompt="same keys", max_tokens=1)
        for token, expected in ((DEV_KEY, 0), ("not-a-key-0000", UNAUTHENTICATED), (NO_SCOPE_KEY, PERMISSION_DENIED)):
            gateway = client.generate(request, token=token)
            assert gateway.code.value[0] == expected
            assert check(channel, bearer(token)).status.code == expected


def test_in_a_spine_whose_auth_is_remote_the_answer_comes_from_the_auth_process(tmp_path: Path) -> None:
    """Mid-migration (auth still remote) Envoy's Check on the spine is the auth process's
    decision; when that process cannot answer, the call fails UNAVAILABLE (Envoy's
    `failure_mode_allow` decides), and the service answers again once it is back."""
    config = config_for_tests(placements={"auth": "remote", "ratelimit": "local"}, envoy_api=ENVOY_LISTENER)
    stack = start_stack("mixed", tmp_path, config)
    try:
        assert stack.supervisor is not None
        pid = stack.supervisor.children["auth"].pid
        assert pid is not None
        with grpc.insecure_channel(envoy_address(stack)) as channel:
            assert ok_headers(check(channel, bearer(DEV_KEY)))["x-spine-tenant"].header.value == "dev"
            stop_process(pid)  # our own child: it stops answering
            try:
                with pytest.raises(grpc.RpcError) as failed:
                    check(channel, bearer(DEV_KEY))
            finally:
                os.kill(pid, signal.SIGCONT)
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "auth unavailable" in (failed.value.details() or "")
            # It answers again within 10 s (a hung child may also be restarted by its
            # supervisor meanwhile: the answer that counts is the first good one).
            def recovered() -> bool:
                try:
                    return check(channel, bearer(DEV_KEY)).status.code == 0
                except grpc.RpcError:  # ejected for a moment after the failure
                    return False

            eventually(recovered, 10, "auth answering OK again", interval=0.2)
    finally:
        stack.stop()
