"""Certificates and TLS clients for the TLS tests: `spine certs dev`'s files, plus a client
certificate from another CA and an expired one from the right CA."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from spine.tools.dev_certs import Authority, issue, make_authority, write_dev_certs, write_file


@dataclass(frozen=True)
class Certs:
    dir: Path
    ca: Path
    server: Path
    server_key: Path
    client: Path
    client_key: Path
    other_client: Path  # from another CA
    other_client_key: Path
    expired_client: Path  # from the right CA, expired yesterday
    expired_client_key: Path

    def tls_config(self, **extra: Any) -> dict[str, Any]:
        return {"cert_file": str(self.server), "key_file": str(self.server_key), "client_ca_file": str(self.ca),
                **extra}

    def credentials(self, who: str | None = "client", ca: Path | None = None) -> grpc.ChannelCredentials:
        """TLS trusting the dev CA (or `ca`), presenting `who`'s certificate (None: none)."""
        pairs = {"client": (self.client, self.client_key), "other": (self.other_client, self.other_client_key),
                 "expired": (self.expired_client, self.expired_client_key),
                 "server": (self.server, self.server_key)}
        root = (ca or self.ca).read_bytes()
        if who is None:
            return grpc.ssl_channel_credentials(root)
        cert, key = pairs[who]
        return grpc.ssl_channel_credentials(root, key.read_bytes(), cert.read_bytes())


def write_issued(folder: Path, name: str, authority: Authority, **kwargs: Any) -> tuple[Path, Path]:
    issued = issue(authority, name, **kwargs)
    return (write_file(folder / f"{name}.pem", issued.certificate_pem, 0o644),
            write_file(folder / f"{name}-key.pem", issued.key_pem, 0o600))


def make_certs(folder: Path) -> Certs:
    paths = write_dev_certs(folder)
    other_ca = make_authority("another CA")
    other, other_key = write_issued(folder, "other-client", other_ca)
    # The dev CA's key is thrown away by `spine certs dev`: the expired certificate comes
    # from a CA made here whose certificate is added to the trusted bundle.
    now = datetime.datetime.now(datetime.UTC)
    second = make_authority("spine dev CA 2")
    expired, expired_key = write_issued(folder, "expired-client", second, not_before=now - datetime.timedelta(days=10),
                                        not_after=now - datetime.timedelta(days=1))
    bundle = paths["ca.pem"].read_bytes() + second.pem
    write_file(paths["ca.pem"], bundle, 0o644)
    return Certs(folder, paths["ca.pem"], paths["server.pem"], paths["server-key.pem"], paths["client.pem"],
                 paths["client-key.pem"], other, other_key, expired, expired_key)


def channel(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.Channel:
    """A fresh channel (its own subchannel: a new connection, so a new handshake)."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    if credentials is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, credentials, options=options)


def health(address: str, credentials: grpc.ChannelCredentials | None, timeout: float = 5.0) -> str:
    """The health status name, or the code name of the failed call."""
    with channel(address, credentials) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError as error:
            return str(error.code().name)  # type: ignore[attr-defined]
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
