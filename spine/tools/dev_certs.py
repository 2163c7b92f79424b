"""`spine certs dev --out DIR`: a throwaway CA and certificates, for local trials and tests only.

NEVER for production. The CA is made on the spot and its key is thrown away once the two
certificates are signed, so nothing else can ever be signed by it (and nothing leaks that
could): a deployment gets its certificates from its own CA (cert-manager in Kubernetes, see
deploy/README.md). What it writes:

| file | what | mode |
|---|---|---|
| `ca.pem` | the CA certificate: `tls.client_ca_file` of a server, `--ca` of a client | 0644 |
| `server.pem`, `server-key.pem` | valid for `localhost` and `127.0.0.1`; serverAuth and clientAuth (a spine process is also the client of its own layered children and of the controller) | 0644, 0600 |
| `client.pem`, `client-key.pem` | a client certificate (clientAuth), CN `spine-dev-client` | 0644, 0600 |

Keys are ECDSA P-256. `make_authority` and `issue` are the pieces, for tests that need a
certificate from another CA, or an expired one.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

FILES = ("ca.pem", "server.pem", "server-key.pem", "client.pem", "client-key.pem")
KEYS = ("server-key.pem", "client-key.pem")
SERVER_NAMES = ("localhost", "127.0.0.1")
WARNING = ("for local trials and tests only, never for production: the CA was made on the spot and its "
           "key thrown away; a deployment takes its certificates from its own CA (cert-manager, see "
           "deploy/README.md)")


@dataclass(frozen=True)
class Authority:
    key: ec.EllipticCurvePrivateKey
    certificate: x509.Certificate

    @property
    def pem(self) -> bytes:
        return self.certificate.public_bytes(serialization.Encoding.PEM)


@dataclass(frozen=True)
class Issued:
    certificate_pem: bytes
    key_pem: bytes


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "spine dev"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_authority(common_name: str = "spine dev CA", days: int = 30) -> Authority:
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    certificate = (
        x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(_name(common_name))
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256()))
    return Authority(key, certificate)


def issue(authority: Authority, common_name: str, *, names: Sequence[str] = (), server: bool = False,
          client: bool = True, not_before: datetime.datetime | None = None,
          not_after: datetime.datetime | None = None, days: int = 30) -> Issued:
    """A leaf certificate signed by `authority`: `names` (DNS names or IP addresses) as its
    subject alternative names, serverAuth and/or clientAuth usage, valid from `not_before`
    (default: five minutes ago) to `not_after` (default: `days` from now)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    usages = [*([ExtendedKeyUsageOID.SERVER_AUTH] if server else []),
              *([ExtendedKeyUsageOID.CLIENT_AUTH] if client else [])]
    builder = (
        x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(authority.certificate.subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(not_before or now - datetime.timedelta(minutes=5))
        .not_valid_after(not_after or now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, key_cert_sign=False,
                                     crl_sign=False, content_commitment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(authority.key.public_key()),
                       critical=False))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName([_general_name(n) for n in names]),
                                        critical=False)
    certificate = builder.sign(authority.key, hashes.SHA256())
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return Issued(certificate.public_bytes(serialization.Encoding.PEM), key_pem)


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def write_file(path: Path, data: bytes, mode: int) -> Path:
    """Write `data` created with `mode` (a key is never readable by others, not even for a moment)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as file:
        os.fchmod(file.fileno(), mode)
        file.write(data)
    return path


class Exists(FileExistsError):
    """`--out` already holds some of the files (`--force` replaces them)."""


def write_dev_certs(out: Path, *, days: int = 30, force: bool = False) -> dict[str, Path]:
    """Make a CA, a server and a client certificate and write them to `out` (see the module
    docstring); their paths by file name. The CA's key is discarded."""
    existing = [name for name in FILES if (out / name).exists()]
    if existing and not force:
        raise Exists(f"{out} already holds {', '.join(existing)}; pass --force to replace them")
    out.mkdir(parents=True, exist_ok=True)
    authority = make_authority(days=days)
    server = issue(authority, "spine-dev-server", names=SERVER_NAMES, server=True, client=True, days=days)
    client = issue(authority, "spine-dev-client", server=False, client=True, days=days)
    contents = {"ca.pem": authority.pem, "server.pem": server.certificate_pem, "server-key.pem": server.key_pem,
                "client.pem": client.certificate_pem, "client-key.pem": client.key_pem}
    return {name: write_file(out / name, data, 0o600 if name in KEYS else 0o644) for name, data in contents.items()}


def summary(paths: dict[str, Path], days: int) -> str:
    """What `spine certs dev` prints: the files, how to use them, and the warning."""
    folder = paths["ca.pem"].parent
    return "\n".join([
        f"wrote a dev CA and certificates to {folder} (valid {days} days):",
        "  ca.pem                      the CA: tls.client_ca_file of a server, --ca of a client",
        f"  server.pem, server-key.pem  for {' and '.join(SERVER_NAMES)} (key 0600)",
        "  client.pem, client-key.pem  a client certificate (key 0600)",
        "use them:",
        f"  config:  tls: {{cert_file: {folder}/server.pem, key_file: {folder}/server-key.pem, "
        f"client_ca_file: {folder}/ca.pem}}",
        f"  client:  spine call --address localhost:50051 --ca {folder}/ca.pem --cert {folder}/client.pem "
        f"--key {folder}/client-key.pem",
        f"WARNING: {WARNING}",
    ])
