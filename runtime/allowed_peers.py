"""Who may call a listener's services: the names in its client's certificate, against a list.

mTLS says that a client holds a certificate the CA signed; a CA that signs every workload of
a cluster signs far more clients than should spend any tenant's rate limit. Envoy's APIs
(`envoy_api.allowed_peers`) are answered only for a peer whose certificate names one of the
allowed identities: a DNS name among its subject alternative names, or its subject's common
name (what `spine certs dev` and cert-manager issue). Anyone else is PERMISSION_DENIED before
the servicer runs; the handshake itself was already refused for a certificate the CA did not
sign (`runtime.tls`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import grpc

from runtime.server import Interceptor, default_interceptors
from services.common.log_limit import RateLimitedLog

log = logging.getLogger("spine.tls")
_refusals = RateLimitedLog(log, "calls refused for their peer's certificate")

# The auth context's properties that name the peer (gRPC's C core fills them from the certificate).
_NAME_KEYS = ("x509_subject_alternative_name", "x509_common_name")


def peer_names(context: grpc.ServicerContext) -> set[str]:
    """The identities the caller's certificate names (empty without one: plaintext, unix sockets)."""
    auth: Mapping[str, Any] = context.auth_context()  # each value a list of bytes (typed as bytes in the stubs)
    return {bytes(value).decode("utf-8", "replace") for key in _NAME_KEYS for value in auth.get(key, ())}


class AllowedPeers(Interceptor):
    """Refuses the calls to `services` (full service names) from any peer whose certificate
    names none of `allowed`; other services of the server (health, reflection) pass."""

    def __init__(self, allowed: Iterable[str], services: Iterable[str]) -> None:
        self.allowed = frozenset(allowed)
        self._prefixes = tuple(f"/{service}/" for service in services)

    def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(self._prefixes) or handler.unary_unary is None:
            return handler
        inner = handler.unary_unary

        def checked(request: Any, context: grpc.ServicerContext) -> Any:
            names = peer_names(context)
            if not names & self.allowed:
                _refusals(method, "refused %s from %s: its certificate names %s, none of envoy_api.allowed_peers",
                          method, context.peer(), sorted(names) or "nothing (no client certificate)")
                context.abort(grpc.StatusCode.PERMISSION_DENIED,
                              "this caller's certificate is not among the peers allowed to call Envoy's APIs "
                              "(envoy_api.allowed_peers)")
            return inner(request, context)

        return grpc.unary_unary_rpc_method_handler(checked, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)


def envoy_interceptors(peers: Iterable[str], envoy: Iterable[tuple[Any, Any]], mtls: bool) -> list[Interceptor] | None:
    """The interceptors of a server answering Envoy's APIs `envoy` (spec, servicer): the
    process's own, and the peer check when `peers` are named and the listener has client
    certificates to read them from (`mtls`); None: the process's defaults alone."""
    peers = tuple(peers)
    services = [spec.full_name for spec, _ in envoy]
    if not (peers and services and mtls):
        return None
    return [*default_interceptors(), AllowedPeers(peers, services)]
