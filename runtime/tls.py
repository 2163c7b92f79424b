"""TLS and mTLS on every TCP link, with grpcio's own credentials.

One rule for the whole deployment: a process whose config has a `tls:` section
(`runtime.config.sections.TlsConfig`) speaks TLS on every TCP listener it opens and on every
TCP link it dials (a layered child reached over TCP, the controller's xDS, the layered
gateway it mirrors to, the gateways the front splits between); with `client_ca_file` its
listeners require a client certificate signed by that CA. Unix sockets stay plaintext:
they live in 0700 run directories that only this user can reach. Without `tls:` everything
is plaintext, as before. Clients that are not part of the deployment (`spine call`,
`spine migrate`) say what they trust with `--ca [--cert --key]`.

Certificates rotate without a restart: a listener's credentials are
`grpc.dynamic_ssl_server_credentials`, whose fetcher gRPC calls before every handshake;
it re-reads the files when one of them changed (inode, mtime or size — a Kubernetes Secret
update swaps a symlink, `cp` rewrites in place) or after a SIGHUP, checks the new set
(the key matches the certificate, the certificate is valid now, the CA parses) and only
then hands it over; a half-written or mismatched set is logged once and the previous one
kept. Channels read the files when they are made: a long-lived channel keeps presenting
the client certificate it started with (so renew certificates well before they expire, as
cert-manager does at two thirds of their life).

Refused handshakes happen inside gRPC's C core, before any Python code sees the call (a
check of `context.auth_context()` in a handler would come too late for them);
`runtime.core_log` turns the core's own line about each into one `spine.tls` line.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import signal
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from runtime.config.sections import TlsConfig
from services.common import ConfigError

log = logging.getLogger("spine.tls")

Stamp = tuple[tuple[int, int, int] | None, ...]

# SIGHUPs received (`reload_on_sighup`); every fetcher re-reads its files once per new one.
_sighups = [0]


def is_unix(address: str) -> bool:
    """A unix socket address (plaintext under any `tls:`), as gRPC spells one."""
    return address.startswith(("unix:", "unix-abstract:"))


def reload_on_sighup() -> None:
    """Re-read every listener's certificate files at its next handshake after a SIGHUP
    (for a rotation that keeps a file's inode, mtime and size). Main thread only."""

    def on_hup(signum: int, frame: object) -> None:
        _sighups[0] += 1  # no locks in a signal handler

    signal.signal(signal.SIGHUP, on_hup)


@dataclass(frozen=True)
class CertificateSet:
    """The files of one `tls:` section, read and checked."""

    cert_pem: bytes
    key_pem: bytes
    client_ca_pem: bytes | None
    subject: str
    not_after: datetime.datetime

    def server_configuration(self) -> Any:
        return grpc.ssl_server_certificate_configuration([(self.key_pem, self.cert_pem)],
                                                         root_certificates=self.client_ca_pem)


def read_pem(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as error:
        raise ConfigError(f"{what} {path}: cannot read it: {error.strerror}") from None


def setting(where: str, key: str) -> str:
    """What a person calls one of the files: `tls.cert_file` in a config, `--tls-cert-file` on a
    command line (`where` "--tls")."""
    return f"{where}-{key.replace('_', '-')}" if where.startswith("--") else f"{where}.{key}"


def load_certificates(tls: TlsConfig, now: datetime.datetime | None = None, where: str = "tls") -> CertificateSet:
    """Read and check `tls`'s files: ConfigError naming the file and what is wrong with it (not
    PEM, a key that does not match the certificate, a certificate expired or not valid yet)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    cert, key_name, ca = (setting(where, k) for k in ("cert_file", "key_file", "client_ca_file"))
    cert_pem = read_pem(tls.cert_file, cert)
    key_pem = read_pem(tls.key_file, key_name)
    client_ca_pem = read_pem(tls.client_ca_file, ca) if tls.client_ca_file is not None else None
    try:
        chain = x509.load_pem_x509_certificates(cert_pem)
    except ValueError:
        raise ConfigError(f"{cert} {tls.cert_file}: no PEM certificate in it") from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"{key_name} {tls.key_file}: not an unencrypted PEM private key ({error})") from None
    leaf = chain[0]
    subject = leaf.subject.rfc4514_string()
    raw = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if leaf.public_key().public_bytes(*raw) != key.public_key().public_bytes(*raw):
        raise ConfigError(f"{key_name} {tls.key_file}: not the key of {cert} {tls.cert_file} ({subject})")
    now = now or datetime.datetime.now(datetime.UTC)
    if now > leaf.not_valid_after_utc:
        raise ConfigError(f"{cert} {tls.cert_file}: the certificate ({subject}) expired on "
                          f"{leaf.not_valid_after_utc:%Y-%m-%d %H:%M} UTC; renew it")
    if now < leaf.not_valid_before_utc:
        raise ConfigError(f"{cert} {tls.cert_file}: the certificate ({subject}) is not valid before "
                          f"{leaf.not_valid_before_utc:%Y-%m-%d %H:%M} UTC (is this machine's clock right?)")
    if client_ca_pem is not None:
        try:
            x509.load_pem_x509_certificates(client_ca_pem)
        except ValueError:
            raise ConfigError(f"{ca} {tls.client_ca_file}: no PEM certificate in it") from None
    return CertificateSet(cert_pem, key_pem, client_ca_pem, subject, leaf.not_valid_after_utc)


def _stamp(paths: Sequence[str | None]) -> Stamp:
    """What changes when a file is replaced or rewritten (None for a file that cannot be read)."""
    stamps: list[tuple[int, int, int] | None] = []
    for path in paths:
        try:
            st = os.stat(path) if path is not None else None
        except OSError:
            st = None
        stamps.append((st.st_ino, st.st_mtime_ns, st.st_size) if st is not None else None)
    return tuple(stamps)


class ReloadingCertificates:
    """A listener's certificate set, re-read when its files change or after a SIGHUP.

    `fetch` is gRPC's certificate configuration fetcher: called (from the C core) before every
    handshake, it answers None (keep the current set) or the new set. It never raises: a
    set that fails its checks is logged once and the previous one kept."""

    def __init__(self, tls: TlsConfig, where: str = "tls") -> None:
        self.tls = tls
        self.where = where
        self._paths = (tls.cert_file, tls.key_file, tls.client_ca_file)
        self._stamp = _stamp(self._paths)
        self.current = load_certificates(tls, where=where)  # ConfigError at start: one line, exit 2
        self._hups = _sighups[0]
        self._refused: Stamp | None = None
        self._lock = threading.Lock()
        self.reloads = 0

    def fetch(self) -> Any:
        try:
            stamp, hups = _stamp(self._paths), _sighups[0]
            if (stamp == self._stamp or stamp == self._refused) and hups == self._hups:
                return None
            with self._lock:
                return self._reload(stamp, hups)
        except Exception as error:  # raised into the C core it would fail the handshake
            log.warning("%s: could not re-read the certificate files; keeping the current ones: %s",
                        self.where, error)
            return None

    def _reload(self, stamp: Stamp, hups: int) -> Any:
        if stamp == self._stamp and hups == self._hups:
            return None  # another handshake reloaded it meanwhile
        self._hups = hups
        try:
            loaded = load_certificates(self.tls, where=self.where)
        except ConfigError as error:
            if stamp != self._refused:
                log.warning("certificate files changed but cannot be used; still serving %s until they "
                            "can: %s", self.current.subject, error)
            self._refused = stamp
            return None
        self._stamp, self._refused, self.current = stamp, None, loaded
        self.reloads += 1
        log.info("%s: re-read the certificate files: now serving %s, valid until %s UTC", self.where,
                 loaded.subject, f"{loaded.not_after:%Y-%m-%d %H:%M}")
        return loaded.server_configuration()


def server_credentials(tls: TlsConfig, where: str = "tls") -> grpc.ServerCredentials:
    """TLS server credentials that follow the files (mTLS with `client_ca_file`)."""
    certificates = ReloadingCertificates(tls, where)
    return grpc.dynamic_ssl_server_credentials(
        certificates.current.server_configuration(), certificates.fetch,
        require_client_authentication=tls.client_ca_file is not None)


def add_port(server: grpc.Server, listen: str, tls: TlsConfig | None, where: str = "tls") -> int:
    """Bind `listen` on `server`: TLS with `tls` on TCP, plaintext on a unix socket or without `tls`."""
    if tls is None or is_unix(listen):
        return server.add_insecure_port(listen)
    return server.add_secure_port(listen, server_credentials(tls, where))


# -- the client side ------------------------------------------------------------------------

_client_cache: dict[tuple[str | None, ...], tuple[Stamp, grpc.ChannelCredentials]] = {}
_client_lock = threading.Lock()


def channel_credentials(ca_file: str | None, cert_file: str | None = None, key_file: str | None = None,
                        names: tuple[str, str, str] = ("--ca", "--cert", "--key")) -> grpc.ChannelCredentials:
    """TLS channel credentials from files: the CA that signed the server (None: the system's
    roots) and, for mTLS, a client certificate and its key. `names` are what the caller calls
    the three (flags or config keys), for the error message."""
    if (cert_file is None) != (key_file is None):
        raise ConfigError(f"{names[1]} and {names[2]} go together: a client certificate needs its key")
    key = (ca_file, cert_file, key_file)
    stamp = _stamp(key)
    with _client_lock:
        cached = _client_cache.get(key)
        if cached is not None and cached[0] == stamp:
            return cached[1]
    root = read_pem(ca_file, names[0]) if ca_file is not None else None
    chain = read_pem(cert_file, names[1]) if cert_file is not None else None
    private = read_pem(key_file, names[2]) if key_file is not None else None
    credentials = grpc.ssl_channel_credentials(root_certificates=root, private_key=private,
                                               certificate_chain=chain)
    with _client_lock:
        _client_cache[key] = (stamp, credentials)
    return credentials


def link_credentials(tls: TlsConfig | None, address: str) -> grpc.ChannelCredentials | None:
    """How this process dials a part of its own deployment at `address`: TLS with its own
    certificate when it has `tls:` and `address` is TCP, else None (plaintext)."""
    if tls is None or is_unix(address):
        return None
    return channel_credentials(tls.server_ca_file, tls.cert_file, tls.key_file,
                               ("tls.ca_file (or client_ca_file)", "tls.cert_file", "tls.key_file"))


def open_channel(address: str, credentials: grpc.ChannelCredentials | None,
                 options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A secure channel with `credentials`, an insecure one without."""
    if credentials is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, credentials, options=list(options))


def link_channel(address: str, tls: TlsConfig | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A channel to another part of the deployment (`link_credentials`)."""
    return open_channel(address, link_credentials(tls, address), options)


def certificate_name(cert_file: str) -> str | None:
    """The first name (DNS, else IP) a certificate is valid for, None if it has none."""
    from cryptography import x509

    leaf = x509.load_pem_x509_certificates(read_pem(cert_file, "tls.cert_file"))[0]
    try:
        names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    found = [*names.get_values_for_type(x509.DNSName), *map(str, names.get_values_for_type(x509.IPAddress))]
    return found[0] if found else None


def self_channel(address: str, tls: TlsConfig | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A channel from this process to its own listener (the spine's calibration copies): the
    address it listens on (0.0.0.0 in a pod) is in no certificate, so the server is verified
    against the first name of this process's own certificate, which it serves."""
    credentials = link_credentials(tls, address)
    if credentials is None or tls is None:
        return open_channel(address, None, options)
    name = certificate_name(tls.cert_file)
    extra = [("grpc.ssl_target_name_override", name)] if name else []
    return open_channel(address, credentials, [*options, *extra])


# -- clients outside the deployment: `spine call`, `spine migrate` --------------------------------

def add_tls_client_arguments(parser: argparse.ArgumentParser) -> None:
    """--ca, --cert, --key: how a client from outside the deployment speaks TLS to it."""
    parser.add_argument("--ca", metavar="FILE", help="speak TLS, verifying the server against this CA (PEM)")
    parser.add_argument("--cert", metavar="FILE", help="with --ca: present this client certificate (mTLS)")
    parser.add_argument("--key", metavar="FILE", help="with --cert: its private key")


def client_credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    """`--ca FILE [--cert FILE --key FILE]` as channel credentials, or None (plaintext).

    With --ca the core's own line about a handshake this client refuses (the server's
    certificate is from another CA, expired, ...) becomes one `spine.tls` line."""
    if args.ca is None:
        if args.cert or args.key:
            raise ConfigError("--cert/--key: a TLS client needs --ca FILE (the CA that signed the server)")
        return None
    credentials = channel_credentials(args.ca, args.cert, args.key)
    from runtime.core_log import log_tls_refusals

    log_tls_refusals()
    return credentials


def refusal_hint(code: grpc.StatusCode, details: str, tls: bool) -> str | None:
    """What a client that could not connect should try, when it looks like a TLS refusal: a
    server that refuses a handshake just closes the connection, so the client's own error
    only says "Socket closed" (the server's log names the reason)."""
    if code != grpc.StatusCode.UNAVAILABLE:
        return None
    if "handshake failed" in details.lower():
        if "WRONG_VERSION_NUMBER" in details:
            return "the server does not speak TLS: drop --ca/--cert/--key"
        return "this client refused the server's certificate (the reason is above): is --ca the CA that signed it?"
    if "Socket closed" not in details:
        return None
    if not tls:
        return ("the server closed the connection at once: if it serves TLS, pass --ca FILE (and --cert/--key "
                "if it requires a client certificate); its log names the reason")
    return ("the server refused the TLS handshake: it may require a client certificate (--cert/--key) signed "
            "by its tls.client_ca_file, and not expired; its log names the reason")
