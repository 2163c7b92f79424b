"""gRPC's C core writes its log to file descriptor 2; a refused TLS handshake becomes one `spine.tls` line.

A handshake is refused inside the C core, before any Python code sees a call: plaintext to
a TLS listener, a client without the certificate it requires, one from another CA, an
expired one. No handler, interceptor or `context.auth_context()` check runs for them; what
the core does is write one line such as

    I1130 09:34:40.528 2669 ssl_transport_security.cc:2563] Handshake failed with error SSL_ERROR_SSL:
    error:100000c0:SSL routines:OPENSSL_internal:PEER_DID_NOT_RETURN_A_CERTIFICATE: ...

to fd 2 (through absl's stderr sink; grpcio offers no hook into it). `CoreLogBridge` puts a
pipe on fd 2 and reads it on a daemon thread: each such line becomes one warning on the
`spine.tls` logger that says what happened in words —

    spine.tls WARNING TLS handshake refused: the client presented no certificate, and this
    listener requires one signed by tls.client_ca_file [PEER_DID_NOT_RETURN_A_CERTIFICATE]

— and every other line is passed through to the real stderr unchanged. Python's own
`sys.stderr` is pointed at the real stderr directly, so nothing Python writes depends on the
thread; the pipe's write end is non-blocking, so the core can never block on it (a line is
dropped instead if the reader ever fell 64 KiB behind).

The core writes these lines at INFO, which it does unless `GRPC_VERBOSITY` says ERROR (or
NONE): then refused handshakes are not logged at all, and the bridge says so once at start.
The line carries no peer address (only the core's per-connection trace does, hundreds of
lines per handshake), so it names the reason, not the client.

Installed by the long-running entry points that serve TLS (`spine up`, a layered child on
TCP, the migration controller), never by library code or tests that run servers in-process.
"""

from __future__ import annotations

import io
import logging
import os
import re
import sys
import threading

from services.common.thread_names import name_os_thread

log = logging.getLogger("spine.tls")

_HANDSHAKE = re.compile(r"^[IWEF]\d{4} [\d:.]+\s+\d+ ssl_transport_security\.cc:\d+\] "
                        r"Handshake failed with (?:fatal )?error (?P<error>.*)$")

# What the OpenSSL reasons mean here, most specific first. "peer": the core logs the same line
# whether this process was the server or the client of the handshake.
_REASONS: tuple[tuple[str, str], ...] = (
    ("PEER_DID_NOT_RETURN_A_CERTIFICATE",
     "the client presented no certificate, and this listener requires one signed by tls.client_ca_file"),
    ("certificate has expired", "the peer's certificate has expired"),
    ("certificate is not yet valid", "the peer's certificate is not valid yet (check both clocks)"),
    ("unable to get local issuer certificate",
     "the peer's certificate is not signed by a CA this process trusts (tls.client_ca_file / tls.ca_file)"),
    ("self signed certificate", "the peer's certificate is self-signed, not signed by a CA this process trusts"),
    ("self-signed certificate", "the peer's certificate is self-signed, not signed by a CA this process trusts"),
    ("unsupported certificate purpose",
     "the peer's certificate is not for this use (a client certificate needs the clientAuth usage, a "
     "server's serverAuth)"),
    ("WRONG_VERSION_NUMBER",
     "the peer does not speak TLS (plaintext to a TLS listener, or TLS to a plaintext one)"),
    ("HTTP_REQUEST", "the peer sent plaintext HTTP to a TLS listener"),
    ("TLSV1_ALERT_UNKNOWN_CA", "the peer does not trust the CA that signed this process's certificate"),
    ("SSLV3_ALERT_CERTIFICATE_EXPIRED", "the peer says this process's certificate has expired"),
    ("SSLV3_ALERT_BAD_CERTIFICATE", "the peer refused this process's certificate"),
    ("TLSV1_ALERT_CERTIFICATE_REQUIRED", "the peer requires a client certificate and this process sent none"),
    ("CERTIFICATE_VERIFY_FAILED", "the peer's certificate did not verify"),
)


def describe_handshake_failure(error: str) -> str:
    """One line, in words, for the core's `Handshake failed with error ...` text."""
    words = next((meaning for needle, meaning in _REASONS if needle in error), "the TLS handshake failed")
    detail = error.removesuffix(": Invalid certificate verification context")
    detail = detail.rsplit("OPENSSL_internal:", 1)[-1].strip()
    return f"TLS handshake refused: {words} [{detail}]"


def translate(line: str) -> str | None:
    """The `spine.tls` message for one line of the core's log, or None for a line passed through."""
    match = _HANDSHAKE.match(line.rstrip("\r\n"))
    return describe_handshake_failure(match.group("error")) if match else None


class CoreLogBridge:
    """fd 2 through a pipe: the core's handshake lines become `spine.tls` warnings."""

    def __init__(self) -> None:
        self._real_fd: int | None = None
        self._read_fd: int | None = None
        self._thread: threading.Thread | None = None

    def install(self) -> CoreLogBridge:
        if self._thread is not None:
            return self
        sys.stderr.flush()
        real = os.dup(2)
        read, write = os.pipe()
        os.set_blocking(write, False)
        os.dup2(write, 2)
        os.close(write)
        self._real_fd, self._read_fd = real, read
        old = sys.stderr
        real_stream = io.TextIOWrapper(os.fdopen(os.dup(real), "wb", buffering=0), encoding="utf-8",
                                       errors="backslashreplace", line_buffering=True, write_through=True)
        sys.stderr = real_stream
        for handler in logging.getLogger().handlers:  # handlers made before, on the old stream
            if isinstance(handler, logging.StreamHandler) and handler.stream is old:
                handler.setStream(real_stream)
        self._thread = threading.Thread(target=self._pump, name="grpc-core-log", daemon=True)
        self._thread.start()
        verbosity = os.environ.get("GRPC_VERBOSITY", "").upper()
        if verbosity in ("ERROR", "NONE", "WARNING"):
            log.warning("GRPC_VERBOSITY=%s: gRPC does not log refused TLS handshakes at that level, so they "
                        "will not be logged here (unset it, or set INFO)", verbosity)
        return self

    def _pump(self) -> None:
        name_os_thread()
        assert self._read_fd is not None and self._real_fd is not None
        with os.fdopen(self._read_fd, "rb", buffering=0) as pipe:
            pending = b""
            while True:
                chunk = pipe.read(65536)
                if not chunk:
                    return
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for raw in lines:
                    self._one(raw + b"\n")

    def _one(self, raw: bytes) -> None:
        assert self._real_fd is not None
        message = translate(raw.decode("utf-8", errors="replace"))
        if message is None:
            os.write(self._real_fd, raw)
        else:
            log.warning("%s", message)


_bridge: CoreLogBridge | None = None


def log_tls_refusals() -> CoreLogBridge:
    """What an entry point that serves TLS calls once, early: the bridge, and `spine.tls` at
    INFO (a certificate reload is worth a line) on a configured root logger."""
    global _bridge
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("spine.tls").setLevel(logging.INFO)
    if _bridge is None:
        _bridge = CoreLogBridge().install()
    return _bridge
