"""TLS and mTLS on the public listener of both layouts (`tls: {cert_file, key_file, client_ca_file}`).

With `spine certs dev`'s files both layouts refuse plaintext, a TLS
client without a certificate, a certificate from another CA and an expired one, and answer
health and a Generate to a client that presents `client.pem`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from runtime.config.file import placements_for
from runtime.running_stack import RunningStack
from runtime.stack import Stack
from spine.client.gateway_client import GatewayClient
from tests.conftest import DEV_KEY, config_for_tests, start_stack
from tests.tls_helpers import Certs, channel, health, make_certs
from wire.v1 import generation_pb2

LAYOUTS = ("collapsed", "layered")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def stacks(certs: Certs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RunningStack]]:
    """Both layouts with `tls:`; the layered one's children on unix sockets (plaintext there)."""
    tmp = tmp_path_factory.mktemp("tls-layouts")
    started: dict[str, RunningStack] = {}
    try:
        for layout in LAYOUTS:
            started[layout] = start_stack(layout, tmp, config_for_tests(tls=certs.tls_config()))
        yield started
    finally:
        for stack in started.values():
            stack.stop()


def generate(address: str, credentials: grpc.ChannelCredentials | None) -> tuple[str, str]:
    request = generation_pb2.GenerateRequest(model="tiny-lm", prompt="over tls", max_tokens=3)
    with GatewayClient(address, DEV_KEY, credentials=credentials) as client:
        result = client.generate(request, timeout=20)
    return result.code.name, result.layout


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_client_presenting_client_pem_gets_health_and_answers(stacks: dict[str, RunningStack], certs: Certs,
                                                                layout: str) -> None:
    address = stacks[layout].address
    assert health(address, certs.credentials("client")) == "SERVING"
    assert generate(address, certs.credentials("client")) == ("OK", layout)
    # localhost is in the server certificate too
    assert health(address.replace("127.0.0.1", "localhost"), certs.credentials("client")) == "SERVING"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("who", ["plaintext", "no certificate", "another CA", "expired"])
def test_the_public_listener_refuses(stacks: dict[str, RunningStack], certs: Certs, layout: str, who: str) -> None:
    credentials = {"plaintext": None, "no certificate": certs.credentials(None),
                   "another CA": certs.credentials("other"), "expired": certs.credentials("expired")}[who]
    address = stacks[layout].address
    assert health(address, credentials, timeout=3) == "UNAVAILABLE"
    assert generate(address, credentials)[0] == "UNAVAILABLE"


def test_a_client_refuses_a_server_from_a_ca_it_does_not_trust(stacks: dict[str, RunningStack], certs: Certs) -> None:
    """The other direction: the client verifies the server (its CA is the other client's)."""
    assert health(stacks["collapsed"].address, certs.credentials("client", ca=certs.other_client)) == "UNAVAILABLE"


def test_without_a_client_ca_tls_is_served_to_clients_without_a_certificate(certs: Certs, tmp_path: Path) -> None:
    config = config_for_tests(tls={"cert_file": str(certs.server), "key_file": str(certs.server_key)})
    stack = start_stack("collapsed", tmp_path, config)
    try:
        assert health(stack.address, certs.credentials(None)) == "SERVING"
        assert health(stack.address, None, timeout=3) == "UNAVAILABLE"  # still TLS: plaintext refused
    finally:
        stack.stop()


def test_the_probe_listener_answers_health_alone_in_plaintext(certs: Certs, tmp_path: Path) -> None:
    """Kubernetes' grpc probes cannot speak TLS: `--probe-listen` serves the health service, nothing else."""
    config = config_for_tests(tls=certs.tls_config())
    stack = Stack(config, placements_for("collapsed", config), run_dir=tmp_path / "probe",
                  probe_listen="127.0.0.1:0").start()
    try:
        assert stack.server is not None and stack.server.probe is not None
        probe = stack.server.probe.address
        assert health(probe, None) == "SERVING"
        with channel(probe, None) as ch:  # the Gateway is not on it
            stub = health_pb2_grpc.HealthStub(ch)
            assert stub.Check(health_pb2.HealthCheckRequest(service="spine.v1.Gateway"), timeout=5).status == \
                health_pb2.HealthCheckResponse.SERVING  # the gateway's health, as the probe must see it
            with pytest.raises(grpc.RpcError) as watch:  # no stream can hold the probe's threads
                next(stub.Watch(health_pb2.HealthCheckRequest(), timeout=5))
            assert watch.value.code() == grpc.StatusCode.UNIMPLEMENTED  # type: ignore[attr-defined]
        assert generate(probe, None)[0] == "UNIMPLEMENTED"
        assert health(stack.address, None, timeout=3) == "UNAVAILABLE"  # the real listener stays mTLS
    finally:
        stack.stop()
