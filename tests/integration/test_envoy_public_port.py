"""Envoy's APIs are a trusted data plane's: `ShouldRateLimit` spends any tenant's buckets. A
caller on the spine's public port gets nothing of them, whatever it sends; on a listener beyond
loopback only an allowed peer's certificate is answered; a listener anyone could reach is
refused at start."""

from __future__ import annotations

import sys
from pathlib import Path

import grpc
import pytest

from runtime.config.file import placements_for
from runtime.processes.launch import launch, serving_on
from runtime.running_stack import RunningStack
from runtime.stack import Stack
from services.common import ConfigError
from spine.client.gateway_client import GatewayClient
from tests.conftest import TIGHT_KEY, config_for_tests, start_stack
from tests.envoy_calls import AUTHZ, RLS, bearer, check, descriptor, services, should_rate_limit
from tests.tls_helpers import channel as tls_channel
from tests.tls_helpers import health, make_certs
from wire.v1 import generation_pb2

VICTIM = (("tenant", "tight"), ("model", "tiny-lm"), ("resource", "requests"))  # TIGHT_KEY's tenant, burst 4


def victim_level(stack: RunningStack) -> float | None:
    bucket = stack.local_servicers["ratelimit"].bucket(VICTIM)
    return None if bucket is None else float(bucket.level)


def victim_served(stack: RunningStack) -> bool:
    with GatewayClient(stack.address) as client:
        request = generation_pb2.GenerateRequest(model="tiny-lm", prompt="still mine", max_tokens=1)
        return bool(client.generate(request, token=TIGHT_KEY).ok)


def spend(channel: grpc.Channel) -> grpc.StatusCode:
    """What an attacker sends: the victim's descriptor, three hits at a time (its burst is 4); the code."""
    try:
        should_rate_limit(channel, [descriptor(("tenant", "tight"), ("model", "tiny-lm"), hits=3)])
    except grpc.RpcError as error:
        return error.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def test_an_unauthenticated_caller_on_the_public_port_gets_nothing_and_spends_nothing(tmp_path: Path) -> None:
    stack = start_stack("collapsed", tmp_path, config_for_tests())  # the default envoy_api section
    try:
        before = victim_level(stack)
        with grpc.insecure_channel(stack.address) as public:
            codes = {spend(public) for _ in range(5)}
            with pytest.raises(grpc.RpcError) as checked:
                check(public, bearer(TIGHT_KEY))
            listed = services(public)
        assert codes == {grpc.StatusCode.UNIMPLEMENTED}
        assert checked.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert not {AUTHZ, RLS} & listed  # not even named by reflection
        assert victim_level(stack) == before  # the victim's bucket untouched
        assert victim_served(stack)  # and the victim's next request is served
    finally:
        stack.stop()


def test_beyond_loopback_only_an_allowed_peers_certificate_is_answered(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs")
    config = config_for_tests(tls=certs.tls_config(), envoy_api={"listen": "127.0.0.1:0",
                                                                 "allowed_peers": ["spine-dev-client"]})
    stack = start_stack("collapsed", tmp_path, config)
    try:
        assert stack.envoy_server is not None
        address = stack.envoy_server.address
        before = victim_level(stack)
        # The server's own certificate is signed by the same CA (and may act as a client): not allowed.
        with tls_channel(address, certs.credentials("server")) as other:
            assert spend(other) == grpc.StatusCode.PERMISSION_DENIED
        with tls_channel(address, certs.credentials(None)) as anonymous:  # no certificate: no handshake
            assert spend(anonymous) == grpc.StatusCode.UNAVAILABLE
        assert victim_level(stack) == before
        with tls_channel(address, certs.credentials("client")) as allowed:
            assert spend(allowed) == grpc.StatusCode.OK
        assert victim_level(stack) != before  # the data plane's own call is the one that spends
    finally:
        stack.stop()


def test_a_layered_ratelimit_process_on_tcp_answers_envoy_only_for_an_allowed_peer(tmp_path: Path) -> None:
    """A layered ratelimit pod behind its Service (TCP, mTLS): its own service answers the
    gateway's certificate; its Envoy API only the peers `envoy_api.allowed_peers` names."""
    certs = make_certs(tmp_path / "certs")
    config_path = tmp_path / "config.yaml"
    config_path.write_text(config_for_tests(tls=certs.tls_config(),
                                            envoy_api={"allowed_peers": ["spine-dev-client"]}).to_yaml())
    child = launch("ratelimit", [sys.executable, "-m", "runtime.process", "ratelimit", "--listen", "127.0.0.1:0",
                                 "--config", str(config_path), "--run-dir", str(tmp_path)],
                   log_path=tmp_path / "ratelimit.log")
    try:
        address = str(child.wait_ready(90, serving_on)["address"])
        assert health(address, certs.credentials("server")) == "SERVING"  # the gateway's certificate
        with tls_channel(address, certs.credentials("server")) as gateway:
            assert spend(gateway) == grpc.StatusCode.PERMISSION_DENIED
        with tls_channel(address, certs.credentials("client")) as envoy:
            assert spend(envoy) == grpc.StatusCode.OK
    finally:
        child.stop(20)


@pytest.mark.parametrize(("envoy_api", "tls", "says"), [
    ({"listen": "0.0.0.0:0"}, False, "beyond loopback"),
    ({"listen": "0.0.0.0:0"}, True, "beyond loopback"),  # mTLS alone: every certificate the CA signs
    ({"listen": "127.0.0.1:0", "allowed_peers": ["envoy"]}, False, "tls.client_ca_file"),
])
def test_an_envoy_listener_anyone_could_call_is_refused_at_start(tmp_path: Path, envoy_api: dict[str, object],
                                                                 tls: bool, says: str) -> None:
    extra = {"tls": make_certs(tmp_path / "certs").tls_config()} if tls else {}
    config = config_for_tests(envoy_api=envoy_api, **extra)
    stack = Stack(config, placements_for("collapsed", config), run_dir=tmp_path / "run", allow_external=True)
    with pytest.raises(ConfigError, match=says):
        stack.start()  # what it had started before the refusal is stopped again
