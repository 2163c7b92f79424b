"""The TLS commands and what a person sees: `spine certs dev`, `spine up` with `tls:` (each
refused handshake one `spine.tls` line, no traceback), `spine call` and `spine migrate` with
`--ca --cert --key`, and the controller refusing a listener beyond loopback without TLS.

Commands that take `--ca` run as processes of their own: they route gRPC's C-core log through
a pipe on fd 2 (`runtime.core_log`), which a test must not do to pytest's process.
"""

from __future__ import annotations

import os
import select
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from migration.recording import RecordingTarget
from migration.server import ControllerProcess
from migration.testing import ADMIN_TOKEN
from runtime.config.sections import TlsConfig
from runtime.core_log import translate
from runtime.server import free_port
from spine.cli import main as spine_main
from spine.cli.migrate import ControlClient
from spine.tools.dev_certs import FILES, write_file
from tests.tls_helpers import Certs, make_certs
from tests.waiting import eventually
from wire.v1 import migration_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
SPINE = [sys.executable, "-m", "spine"]


def run(argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("SPINE_ADMIN_TOKEN", "GRPC_VERBOSITY")}
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


# -- spine certs dev --------------------------------------------------------------------------------

def test_certs_dev_writes_a_ca_a_server_and_a_client_certificate_with_private_keys(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "dev"
    assert spine_main(["certs", "dev", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "never for production" in printed and f"client_ca_file: {out}/ca.pem" in printed
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)
    modes = {name: stat.S_IMODE((out / name).stat().st_mode) for name in FILES}
    assert modes == {"ca.pem": 0o644, "server.pem": 0o644, "server-key.pem": 0o600, "client.pem": 0o644,
                     "client-key.pem": 0o600}
    ca = x509.load_pem_x509_certificate((out / "ca.pem").read_bytes())
    server = x509.load_pem_x509_certificate((out / "server.pem").read_bytes())
    client = x509.load_pem_x509_certificate((out / "client.pem").read_bytes())
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["localhost"]
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    usages = {cert: set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
              for cert in (server, client)}
    assert usages[server] == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert usages[client] == {ExtendedKeyUsageOID.CLIENT_AUTH}
    for leaf in (server, client):
        leaf.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_certs_dev_does_not_overwrite_without_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert spine_main(["certs", "dev", "--out", str(tmp_path)]) == 0
    before = (tmp_path / "ca.pem").read_bytes()
    capsys.readouterr()
    assert spine_main(["certs", "dev", "--out", str(tmp_path)]) == 2
    assert "already holds ca.pem" in capsys.readouterr().err and (tmp_path / "ca.pem").read_bytes() == before
    assert spine_main(["certs", "dev", "--out", str(tmp_path), "--force"]) == 0
    assert (tmp_path / "ca.pem").read_bytes() != before


# -- the core's handshake lines, in words -----------------------------------------------------------

# Lines gRPC 1.85's C core wrote for each refusal, as captured from a TLS server.
CORE_LINES = {
    "plaintext": "I1130 09:34:40.523315    2669 ssl_transport_security.cc:2563] Handshake failed with error "
                 "SSL_ERROR_SSL: error:100000f7:SSL routines:OPENSSL_internal:WRONG_VERSION_NUMBER: Invalid "
                 "certificate verification context",
    "no certificate": "I1130 09:34:40.528992    2669 ssl_transport_security.cc:2563] Handshake failed with error "
                      "SSL_ERROR_SSL: error:100000c0:SSL routines:OPENSSL_internal:"
                      "PEER_DID_NOT_RETURN_A_CERTIFICATE: Invalid certificate verification context",
    "another CA": "I1130 09:34:40.531798    2669 ssl_transport_security.cc:2563] Handshake failed with error "
                  "SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: unable "
                  "to get local issuer certificate",
    "expired": "I1130 09:34:40.534760    2670 ssl_transport_security.cc:2563] Handshake failed with error "
               "SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: "
               "certificate has expired",
}
REASONS = {
    "plaintext": "TLS handshake refused: the peer does not speak TLS",
    "no certificate": "TLS handshake refused: the client presented no certificate, and this listener requires one",
    "another CA": "TLS handshake refused: the peer's certificate is not signed by a CA this process trusts",
    "expired": "TLS handshake refused: the peer's certificate has expired",
}


@pytest.mark.parametrize("case", sorted(CORE_LINES))
def test_each_refusal_in_the_cores_log_reads_as_one_line_with_its_reason(case: str) -> None:
    message = translate(CORE_LINES[case] + "\n")
    assert message is not None and message.startswith(REASONS[case]) and "\n" not in message


def test_other_core_lines_pass_through() -> None:
    assert translate("I1130 09:35:14.364531    4992 trace.cc:91] gRPC Tracers: handshaker\n") is None
    assert translate("some library's own line\n") is None


# -- spine up with tls: and spine call ---------------------------------------------------------------

@pytest.fixture(scope="module")
def tls_spine(certs: Certs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """`spine up --layout collapsed` with `tls: {cert_file, key_file, client_ca_file}`."""
    tmp = tmp_path_factory.mktemp("tls-up")
    config = tmp / "tls.yaml"
    config.write_text(yaml.safe_dump({"tls": certs.tls_config()}))
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    process = subprocess.Popen([*SPINE, "--config", str(config), "up", "--layout", "collapsed", "--listen",
                                "127.0.0.1:0", "--http-listen", "127.0.0.1:0", "--run-dir", str(tmp / "run")], cwd=ROOT, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], 120)
        line = process.stdout.readline() if ready else ""
        assert '"event": "ready"' in line, f"spine up did not start: {line!r}"
        yield yaml.safe_load(line)["address"], process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)


def call(address: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return run([*SPINE, "call", "--address", address, "--max-tokens", "2", "--retries", "0", *extra])


def test_spine_up_logs_each_refused_handshake_as_one_line_and_spine_call_gets_through_with_client_pem(
        tls_spine: tuple[str, subprocess.Popen[str]], certs: Certs) -> None:
    address, process = tls_spine
    ca = ["--ca", str(certs.ca)]
    attempts = {
        "plaintext": call(address),
        "no certificate": call(address, *ca),
        "another CA": call(address, *ca, "--cert", str(certs.other_client), "--key", str(certs.other_client_key)),
        "expired": call(address, *ca, "--cert", str(certs.expired_client), "--key", str(certs.expired_client_key)),
    }
    for case, result in attempts.items():
        assert result.returncode == 1 and "status:  UNAVAILABLE" in result.stdout, (case, result.stdout)
        assert "hint:" in result.stdout and "Traceback" not in result.stderr, (case, result.stdout, result.stderr)
    good = call(address, *ca, "--cert", str(certs.client), "--key", str(certs.client_key))
    assert good.returncode == 0 and "status:  OK" in good.stdout and "layout: collapsed" in good.stdout, good.stdout

    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=30)
    refusals = [line for line in stderr.splitlines() if "TLS handshake refused" in line]
    for case, reason in REASONS.items():
        assert [line for line in refusals if reason in line], f"no line for {case}: {stderr}"
    assert all(" spine.tls WARNING TLS handshake refused: " in line for line in refusals), refusals
    assert "Traceback" not in stderr and "ssl_transport_security.cc" not in stderr, stderr


def test_spine_up_refuses_a_certificate_it_cannot_use_with_one_line(certs: Certs, tmp_path: Path) -> None:
    config = tmp_path / "tls.yaml"
    config.write_text(yaml.safe_dump({"tls": certs.tls_config(cert_file=str(certs.expired_client),
                                                               key_file=str(certs.expired_client_key))}))
    result = run([*SPINE, "--config", str(config), "up", "--layout", "collapsed", "--listen", "127.0.0.1:0",
                  "--http-listen", "127.0.0.1:0"])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"config error: tls.cert_file {certs.expired_client}: the certificate (CN=expired-client,O=spine dev) "
        f"expired on {x509.load_pem_x509_certificate(certs.expired_client.read_bytes()).not_valid_after_utc:%Y-%m-%d %H:%M}"
        " UTC; renew it"]


def test_a_tls_section_without_its_key_is_a_config_error(tmp_path: Path) -> None:
    config = tmp_path / "tls.yaml"
    config.write_text("tls:\n  cert_file: /x/server.pem\n")
    result = run([*SPINE, "--config", str(config), "config", "check"])
    assert result.returncode == 2 and result.stderr.strip() == f"config error: {config}:1: tls.key_file: required"


# -- the controller -------------------------------------------------------------------------------------

def runner_argv(tmp: Path, *extra: str) -> list[str]:
    token = write_file(tmp / "token", ADMIN_TOKEN.encode(), 0o600)
    return [sys.executable, "-m", "migration.runner", "--db", str(tmp / "m.db"), "--admin-token-file", str(token),
            "--target", "recording", "--recording-file", str(tmp / "applies.jsonl"), *extra]


@pytest.mark.parametrize("listen", ["0.0.0.0:50070", "10.1.2.3:50070"])
def test_the_controller_refuses_a_listener_beyond_loopback_without_tls(tmp_path: Path, listen: str) -> None:
    result = run(runner_argv(tmp_path, "--listen", listen, "--allow-external"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: --listen {listen}: a controller listener beyond loopback needs TLS (--tls-cert-file, "
        "--tls-key-file, and --tls-client-ca-file for mTLS): without it the admin token and the stages would "
        "cross the network in plaintext"]


def test_the_controller_refuses_an_xds_listener_beyond_loopback_without_tls(tmp_path: Path) -> None:
    argv = runner_argv(tmp_path, "--listen", f"unix:{tmp_path}/c.sock", "--allow-external")
    argv[argv.index("recording")] = "xds"
    result = run([*argv, "--xds-listen", "0.0.0.0:18000", "--layered", "127.0.0.1:1", "--spine", "127.0.0.1:2",
                  "--layered-metrics", "http://127.0.0.1:1/metrics", "--spine-metrics", "http://127.0.0.1:2/metrics"])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().endswith("--xds-listen 0.0.0.0:18000: a controller listener beyond loopback needs "
                                          "TLS (--tls-cert-file, --tls-key-file, and --tls-client-ca-file for "
                                          "mTLS): without it the admin token and the stages would cross the "
                                          "network in plaintext")


def test_a_controller_with_tls_serves_beyond_loopback_and_spine_migrate_needs_the_client_certificate(
        certs: Certs, tmp_path: Path) -> None:
    port = free_port()
    tls = TlsConfig(**certs.tls_config())
    process = ControllerProcess(str(tmp_path / "m.db"), f"0.0.0.0:{port}", ADMIN_TOKEN,
                                RecordingTarget(str(tmp_path / "applies.jsonl")), allow_external=True, tls=tls)
    process.start()
    try:
        with_cert = ControlClient(f"127.0.0.1:{port}", ADMIN_TOKEN, credentials=certs.credentials("client"))
        assert with_cert.call("Status", pb.StatusRequest()).state
        with_cert.close()
        plain = ControlClient(f"127.0.0.1:{port}", ADMIN_TOKEN)
        with pytest.raises(grpc.RpcError) as refused:
            plain.call("Status", pb.StatusRequest())
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
        plain.close()

        token = write_file(tmp_path / "token", ADMIN_TOKEN.encode(), 0o600)
        migrate = [sys.executable, "-m", "spine.cli.migrate", "migrate", "status", "--json", "--controller",
                   f"localhost:{port}", "--admin-token-file", str(token), "--ca", str(certs.ca)]
        ok = run([*migrate, "--cert", str(certs.client), "--key", str(certs.client_key)])
        assert ok.returncode == 0 and '"state"' in ok.stdout, ok.stderr
        no_cert = run(migrate)
        assert no_cert.returncode == 4 and "Traceback" not in no_cert.stderr
        assert "hint: the server refused the TLS handshake: it may require a client certificate" in no_cert.stderr
    finally:
        process.stop()


def test_the_runner_serves_tls_on_loopback_and_its_probe_listener_in_plaintext(certs: Certs, tmp_path: Path) -> None:
    from tests.tls_helpers import health

    port, probe = free_port(), free_port()
    argv = runner_argv(tmp_path, "--listen", f"127.0.0.1:{port}", "--tls-cert-file", str(certs.server),
                       "--tls-key-file", str(certs.server_key), "--tls-client-ca-file", str(certs.ca),
                       "--probe-listen", f"127.0.0.1:{probe}")
    env = {k: v for k, v in os.environ.items() if k != "SPINE_ADMIN_TOKEN"}
    runner = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        def serving() -> bool:
            assert runner.poll() is None, runner.stderr.read() if runner.stderr else ""
            return health(f"127.0.0.1:{probe}", None, timeout=1) == "SERVING"

        eventually(serving, 60, "the runner's probe listener SERVING", interval=0.2)
        assert health(f"127.0.0.1:{port}", certs.credentials("client")) == "SERVING"
        assert health(f"127.0.0.1:{port}", None, timeout=3) == "UNAVAILABLE"
    finally:
        runner.send_signal(signal.SIGTERM)
        _, stderr = runner.communicate(timeout=30)
    assert "spine.tls WARNING TLS handshake refused: the peer does not speak TLS" in stderr, stderr
    assert "Traceback" not in stderr
