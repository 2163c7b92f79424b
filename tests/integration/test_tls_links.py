"""TLS on the deployment's own links: a layered hop over TCP, the controller's xDS and its
followers, the front, the A/B tool; and certificates re-read without a restart."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from migration.traffic.cutover import Cutover
from migration.xds import Endpoint, XdsControlPlane
from runtime.config.file import placements_for
from runtime.config.sections import TlsConfig
from runtime.processes.launch import launch, serving_on
from runtime.stack import Stack
from runtime.stage_follower import ROLE_LAYERED_RATELIMIT, StageFollower
from runtime.tls import ReloadingCertificates, reload_on_sighup
from services.auth.api import AUTH
from spine.client.gateway_client import GatewayClient
from spine.tools.ab.interleave import RunOptions, run_ab
from spine.tools.dev_certs import issue, make_authority, write_file
from spine.tools.workload.generator import SyntheticSpec, synthetic, tenant_keys
from tests.conftest import DEV_KEY, config_for_tests, start_stack
from tests.tls_helpers import Certs, health, make_certs
from tests.waiting import eventually
from wire.v1 import generation_pb2


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def ask(address: str, credentials: object, token: str = DEV_KEY) -> str:
    request = generation_pb2.GenerateRequest(model="tiny-lm", prompt="a hop", max_tokens=2)
    with GatewayClient(address, token, credentials=credentials) as client:  # type: ignore[arg-type]
        return client.generate(request, timeout=20).code.name


# -- the layered hop: a child reached over TCP -------------------------------------------------

@pytest.fixture(scope="module")
def tcp_auth(certs: Certs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """`python -m runtime.process auth` on 127.0.0.1 with `tls:` in its config, as a
    layered auth pod behind its Service; (its address, its log)."""
    tmp = tmp_path_factory.mktemp("tcp-auth")
    config_path = tmp / "config.yaml"
    config_path.write_text(config_for_tests(tls=certs.tls_config()).to_yaml())
    log_path = tmp / "auth.log"
    child = launch("auth", [sys.executable, "-m", "runtime.process", "auth", "--listen", "127.0.0.1:0",
                            "--config", str(config_path), "--run-dir", str(tmp)], log_path=log_path)
    try:
        yield str(child.wait_ready(90, serving_on)["address"]), log_path
    finally:
        child.stop(20)


def test_a_layered_child_on_tcp_serves_mtls_only(tcp_auth: tuple[str, Path], certs: Certs) -> None:
    address, log_path = tcp_auth
    assert health(address, certs.credentials("server")) == "SERVING"  # a gateway's own certificate
    assert health(address, None, timeout=3) == "UNAVAILABLE"
    assert health(address, certs.credentials(None), timeout=3) == "UNAVAILABLE"
    eventually(lambda: "no certificate" in log_path.read_text(), what="the refused handshakes logged")
    text = log_path.read_text()
    assert "spine.tls WARNING TLS handshake refused: the peer does not speak TLS" in text
    assert "spine.tls WARNING TLS handshake refused: the client presented no certificate" in text
    assert "Traceback" not in text and "ssl_transport_security.cc" not in text


def test_the_gateway_calls_a_child_over_tcp_with_mtls(tcp_auth: tuple[str, Path], certs: Certs,
                                                      tmp_path: Path) -> None:
    """A spine whose auth is the TCP child: the hop is mTLS, so the child's decisions reach the
    client; the same spine without `tls:` cannot reach it at all."""
    address, _ = tcp_auth
    placements = placements_for("collapsed", config_for_tests()) | {"auth": "remote"}
    with Stack(config_for_tests(tls=certs.tls_config()), placements, run_dir=tmp_path / "tls",
               remote_addresses={"auth": address}).start() as stack:
        assert getattr(stack.component(AUTH), "placement", None) == "remote"
        assert ask(stack.address, certs.credentials("client")) == "OK"
        assert ask(stack.address, certs.credentials("client"), token="not-a-key") == "UNAUTHENTICATED"
        assert stack.health_report()["components"]["auth"]["serving"] is True
    with Stack(config_for_tests(), placements, run_dir=tmp_path / "plain", remote_addresses={"auth": address},
               health_interval_s=0.2).start() as plain:
        assert plain.health_report()["components"]["auth"]["serving"] is False
        assert ask(plain.address, None) == "UNAVAILABLE"


# -- the controller's xDS and its followers ---------------------------------------------------------

def test_a_follower_takes_its_stage_over_mtls_and_a_plaintext_one_gets_nothing(certs: Certs) -> None:
    tls = TlsConfig(**certs.tls_config())
    plane = XdsControlPlane("spine-gateway", {"layered": [Endpoint("127.0.0.1", 1)],
                                              "spine": [Endpoint("127.0.0.1", 2)]})
    address = plane.start("127.0.0.1:0", tls)
    plane.set_stage(0, None, "v1")
    applied: list[object] = []
    followers = [StageFollower(address, "limiter-tls", ROLE_LAYERED_RATELIMIT, applied.append, tls=tls).start(),
                 StageFollower(address, "limiter-plain", ROLE_LAYERED_RATELIMIT, applied.append).start()]
    try:
        assert followers[0].wait_applied(20), followers[0].state()
        assert followers[0].state()["applied_version"].startswith("v1")  # v1+m1: republished as it joined
        assert not followers[1].wait_applied(2)
        assert len(applied) == 1
        assert [row["node_id"] for row in plane.followers_status()] == ["limiter-tls"]
    finally:
        for follower in followers:
            follower.stop()
        plane.stop()


# -- the front, the A/B tool ------------------------------------------------------------------------

def test_the_front_splits_between_two_mtls_gateways(certs: Certs, tmp_path: Path) -> None:
    rig = Cutover(config_for_tests(tls=certs.tls_config()), tmp_path).start()
    try:
        assert rig.endpoint_health is not None and rig.front is not None
        assert rig.endpoint_health.check_once() == {"layered": True, "spine": True}
        request = generation_pb2.GenerateRequest(model="tiny-lm", prompt="through the front", max_tokens=2)
        with GatewayClient(rig.address, DEV_KEY, credentials=certs.credentials("client")) as client:
            sides = {side: client.generate(request, headers={"x-spine-route": side}, timeout=20)
                     for side in ("layered", "spine")}
        assert {side: (r.code.name, r.layout) for side, r in sides.items()} == {
            "layered": ("OK", "layered"), "spine": ("OK", "mixed")}
        assert health(rig.address, None, timeout=3) == "UNAVAILABLE"
    finally:
        rig.stop()


def test_the_ab_tool_measures_a_tls_target(certs: Certs, tmp_path: Path) -> None:
    config = config_for_tests(tls=certs.tls_config())
    stack = start_stack("collapsed", tmp_path, config)
    try:
        entries = synthetic(SyntheticSpec(count=6, seed=3, tenants={"dev": 1.0}), tenant_keys(config.auth))
        run = run_ab(config, [], entries, tmp_path / "ab", targets={"tls-spine": stack.address},
                     options=RunOptions(concurrency=2, warmup=1, time_limit_s=60))
    finally:
        stack.stop()
    (measured,) = run.runs
    assert measured.status == "up", measured.error
    assert [r.code.name for r in measured.results if r is not None] == ["OK"] * 6


# -- certificates re-read without a restart --------------------------------------------------------

def write_pair(folder: Path, authority_name: str) -> tuple[Path, bytes, bytes, bytes, bytes, bytes]:
    """A new CA, a server certificate and a client certificate from it: (the CA's file, server
    cert, server key, client cert, client key, CA pem)."""
    authority = make_authority(authority_name)
    server = issue(authority, "rotated-server", names=("localhost", "127.0.0.1"), server=True)
    client = issue(authority, "rotated-client")
    ca = write_file(folder / f"{authority_name}.pem", authority.pem, 0o644)
    return ca, server.certificate_pem, server.key_pem, client.certificate_pem, client.key_pem, authority.pem


def test_swapped_certificate_files_serve_new_handshakes_without_a_restart(
        certs: Certs, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import grpc

    live = tmp_path / "live"
    live.mkdir()
    for name in ("server.pem", "server-key.pem", "ca.pem"):
        shutil.copy(certs.dir / name, live / name)
    config = config_for_tests(tls={"cert_file": str(live / "server.pem"), "key_file": str(live / "server-key.pem"),
                                   "client_ca_file": str(live / "ca.pem")})
    new_ca, new_cert, new_key, new_client, new_client_key, new_ca_pem = write_pair(tmp_path, "rotated-ca")
    new_credentials = grpc.ssl_channel_credentials(new_ca_pem, new_client_key, new_client)
    stack = start_stack("collapsed", tmp_path, config)
    caplog.set_level(logging.INFO, logger="spine.tls")
    try:
        assert health(stack.address, certs.credentials("client")) == "SERVING"
        assert health(stack.address, new_credentials, timeout=3) == "UNAVAILABLE"

        (live / "server.pem").write_bytes(new_cert)  # half a swap: the key does not match yet
        assert health(stack.address, certs.credentials("client")) == "SERVING"  # the old set, kept
        assert "cannot be used" in caplog.text and "not the key of" in caplog.text

        (live / "server-key.pem").write_bytes(new_key)
        (live / "ca.pem").write_bytes(new_ca_pem)
        assert health(stack.address, new_credentials) == "SERVING"  # the new server and client CA
        assert health(stack.address, certs.credentials("client"), timeout=3) == "UNAVAILABLE"  # old CA: refused
        assert health(stack.address, certs.credentials("client", ca=new_ca), timeout=3) == "UNAVAILABLE"
        assert "re-read the certificate files: now serving" in caplog.text
        assert ask(stack.address, new_credentials) == "OK"
    finally:
        stack.stop()


def test_sighup_re_reads_the_files_even_when_they_look_unchanged(certs: Certs) -> None:
    certificates = ReloadingCertificates(TlsConfig(**certs.tls_config()))
    assert certificates.fetch() is None  # nothing changed: gRPC keeps what it has
    previous = signal.getsignal(signal.SIGHUP)
    try:
        reload_on_sighup()
        os.kill(os.getpid(), signal.SIGHUP)
        eventually(certificates.fetch, timeout=5, what="the certificates read again after SIGHUP")
        assert certificates.reloads == 1
        assert certificates.fetch() is None
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_a_process_reaches_its_own_wildcard_listener_by_its_certificates_name(certs: Certs, tmp_path: Path) -> None:
    """The spine's calibration copies go to its own listener, 0.0.0.0 in a pod: a name in no
    certificate, so the channel checks the server against the process's own certificate."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from runtime.tls import link_channel, self_channel

    config = config_for_tests(tls=certs.tls_config())
    stack = Stack(config, placements_for("collapsed", config), listen="0.0.0.0:0", allow_external=True,
                  run_dir=tmp_path / "wildcard").start()
    tls = TlsConfig(**certs.tls_config())
    try:
        assert stack.address.startswith("0.0.0.0:")
        answers = []
        for make in (self_channel, link_channel):
            with make(stack.address, tls) as ch:
                try:
                    reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
                    answers.append(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
                except grpc.RpcError as error:
                    answers.append(error.code().name)  # type: ignore[attr-defined]
        assert answers == ["SERVING", "UNAVAILABLE"]
    finally:
        stack.stop()
