"""Envoy's external authorization API (`envoy.service.auth.v3.Authorization`), both ways.

Serving it (`EnvoyAuthorization`): Envoy's `ext_authz` filter asks `Check` and gets the Auth
component's own decision, from its `check` as placed now (the same API keys, JWT settings and
verification cache as the Gateway path):

- a bearer credential in the `authorization` header that authenticates → OK; the tenant goes
  upstream as `x-spine-tenant` (overwriting whatever a client sent under that name) and every
  other `x-spine-*` header the client sent is removed; the principal is also in the
  response's dynamic metadata (`tenant`, `subject`, `method`, `max_priority`, `scopes`);
- no credential, an unknown or bad one, a malformed header → denied, HTTP 401 with
  `www-authenticate: Bearer` and the reason as body (status UNAUTHENTICATED); a credential
  without the required scope → 403 (PERMISSION_DENIED). A bad request never raises.
- Auth itself unreachable → the call fails UNAVAILABLE, and Envoy's `failure_mode_allow`
  decides (the bootstrap in `deploy/envoy/` denies).

Speaking it (`EnvoyAuthzClient`): the `Auth` interface (`services.auth.api`) answered by a
service the team already runs. Each distinct credential of a `check` becomes one
`Authorization.Check` (sent together); OK with the tenant in `tenant_header` (or in the
dynamic metadata) is the principal, a denial is UNAUTHENTICATED (401) or PERMISSION_DENIED.
An OK that names no tenant is an INTERNAL item: the request fails closed (UNAVAILABLE).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.auth.v3 import attribute_context_pb2, external_auth_pb2, external_auth_pb2_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from google.rpc import status_pb2

from services.auth.api import Auth, CheckVerdict
from services.common import status_code
from services.pipeline.batch_rpc import ItemError
from services.pipeline.envoy_calls import header_safe, printable, rpc_status
from services.pipeline.interface import NO_OPTIONS, CallOptions
from services.pipeline.verdicts import MISSING_CREDENTIAL, bearer, internal_addresses_hidden
from wire.v1 import auth_pb2

TENANT_HEADER = "x-spine-tenant"
INTERNAL_PREFIX = "x-spine-"
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
_PERMISSION_DENIED = grpc.StatusCode.PERMISSION_DENIED
# The path a translated Check names: Envoy's filter would see the Gateway's rpc.
_GATEWAY_PATH = "/spine.v1.Gateway/Generate"


# -- serving Envoy ---------------------------------------------------------------------------


def request_headers(request: external_auth_pb2.CheckRequest) -> list[tuple[str, str]]:
    """The HTTP request's headers as (lowercase key, value) pairs, from `headers` or `header_map`."""
    http = request.attributes.request.http
    pairs = [(key.lower(), value) for key, value in http.headers.items()]
    for header in http.header_map.headers:
        value = header.value or header.raw_value.decode("utf-8", errors="replace")
        pairs.append((header.key.lower(), value))
    return pairs


def credential_of(headers: Iterable[tuple[str, str]]) -> tuple[str | None, str]:
    """(the bearer token, "") or (None, why there is none): the Gateway's own rule (`bearer`)."""
    values = [value for key, value in headers if key == "authorization"]
    if len(values) > 1:
        return None, "malformed credential: more than one authorization header"
    token = bearer([("authorization", values[0])]) if values else None
    if token is None:
        return None, MISSING_CREDENTIAL
    return token, ""


def denied(code: grpc.StatusCode, reason: str) -> external_auth_pb2.CheckResponse:
    """A denial: 401 for UNAUTHENTICATED (with a Bearer challenge), 403 for anything else."""
    http = http_status_pb2.Unauthorized if code == _UNAUTHENTICATED else http_status_pb2.Forbidden
    response = external_auth_pb2.CheckResponse(
        status=status_pb2.Status(code=code.value[0], message=reason),
        denied_response=external_auth_pb2.DeniedHttpResponse(status=http_status_pb2.HttpStatus(code=http),
                                                              body=reason))
    if code == _UNAUTHENTICATED:
        response.denied_response.headers.add(header=base_pb2.HeaderValue(key="www-authenticate",
                                                                         value='Bearer realm="spine"'))
    return response


def allowed(verdict: auth_pb2.CheckResponse, headers: Iterable[tuple[str, str]]) -> external_auth_pb2.CheckResponse:
    """OK: the tenant forwarded as `x-spine-tenant`, a client's own `x-spine-*` headers removed."""
    principal = verdict.principal
    if not header_safe(principal.tenant):
        return denied(_PERMISSION_DENIED, f"tenant {printable(principal.tenant, 64)!r} cannot be forwarded "
                                          f"as the {TENANT_HEADER} header")
    ok = external_auth_pb2.OkHttpResponse(
        headers=[base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=TENANT_HEADER, value=principal.tenant),
                                            append_action=_OVERWRITE)],
        headers_to_remove=sorted({key for key, _ in headers
                                  if key.startswith(INTERNAL_PREFIX) and key != TENANT_HEADER}))
    metadata = struct_pb2.Struct()
    metadata.update({"tenant": principal.tenant, "subject": principal.subject, "method": verdict.method,
                     "max_priority": principal.max_priority, "scopes": list(principal.scopes)})
    if principal.team or principal.models or principal.budget_usd or principal.requests_per_minute \
            or principal.tokens_per_minute:  # a key managed at run time: what it may do, for a spine behind Envoy
        metadata.update({"team": principal.team, "models": list(principal.models),
                         "requests_per_minute": principal.requests_per_minute,
                         "tokens_per_minute": principal.tokens_per_minute, "budget_usd": principal.budget_usd,
                         "budget_window": principal.budget_window})
    return external_auth_pb2.CheckResponse(status=status_pb2.Status(code=0), ok_response=ok,
                                           dynamic_metadata=metadata)


class EnvoyAuthorization(external_auth_pb2_grpc.AuthorizationServicer):
    """`Authorization.Check` answered with the Auth component's decision: `auth()` is the
    component as placed at the time of each call, asked within `budget_s`."""

    def __init__(self, auth: Callable[[], Auth], budget_s: float) -> None:
        self._auth = auth
        self._budget_s = budget_s

    def Check(self, request: external_auth_pb2.CheckRequest, context: Any) -> external_auth_pb2.CheckResponse:
        headers = request_headers(request)
        token, reason = credential_of(headers)
        if token is None:
            return denied(_UNAUTHENTICATED, reason)
        try:
            verdicts = self._auth().check([token], CallOptions(timeout=self._budget_s))
        except grpc.RpcError as error:
            code, details = rpc_status(error)
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"auth unavailable ({code.name}: {internal_addresses_hidden(details)})")
            raise AssertionError("context.abort returned") from None  # pragma: no cover
        if len(verdicts) != 1:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"auth answered {len(verdicts)} results for 1")
        verdict = verdicts[0]
        if isinstance(verdict, ItemError):
            return denied(verdict.code, verdict.message)
        return allowed(verdict, headers)


# -- speaking Envoy ----------------------------------------------------------------------------


def check_request_for(credential: str) -> external_auth_pb2.CheckRequest:
    """What Envoy's filter would send for a Gateway call carrying `credential`."""
    http = attribute_context_pb2.AttributeContext.HttpRequest(
        method="POST", path=_GATEWAY_PATH, protocol="HTTP/2",
        headers={"authorization": f"Bearer {credential}", "content-type": "application/grpc"})
    return external_auth_pb2.CheckRequest(attributes=attribute_context_pb2.AttributeContext(
        request=attribute_context_pb2.AttributeContext.Request(http=http)))


def _header(options: Iterable[base_pb2.HeaderValueOption], name: str) -> str:
    for option in options:
        if option.header.key.lower() == name:
            value: str = option.header.value or option.header.raw_value.decode("utf-8", errors="replace")
            return value
    return ""


def _metadata(struct: struct_pb2.Struct, key: str) -> Any:
    return struct.fields.get(key)


def verdict_from(response: external_auth_pb2.CheckResponse, tenant_header: str = TENANT_HEADER) -> CheckVerdict:
    """An ext_authz answer as the verdict of the `check` item it stands for."""
    if response.status.code != 0:
        code = status_code(response.status.code)
        if code not in (_UNAUTHENTICATED, _PERMISSION_DENIED):
            http = response.denied_response.status.code
            code = _UNAUTHENTICATED if http == http_status_pb2.Unauthorized else _PERMISSION_DENIED
        reason = response.status.message or response.denied_response.body or f"denied by ext_authz ({code.name})"
        return ItemError(code, printable(reason))
    metadata = response.dynamic_metadata
    tenant = _header(response.ok_response.headers, tenant_header.lower())
    if not tenant and (value := _metadata(metadata, "tenant")) is not None:
        tenant = value.string_value
    if not tenant:
        return ItemError(grpc.StatusCode.INTERNAL,
                         f"ext_authz allowed the request but named no tenant (no {tenant_header!r} header "
                         "and no 'tenant' in its dynamic metadata)")
    verdict = auth_pb2.CheckResponse(method="envoy-ext-authz")
    principal = verdict.principal
    principal.tenant = tenant
    if (value := _metadata(metadata, "subject")) is not None:
        principal.subject = value.string_value
    if (value := _metadata(metadata, "max_priority")) is not None:
        principal.max_priority = int(value.number_value)
    if (value := _metadata(metadata, "scopes")) is not None:
        principal.scopes.extend(item.string_value for item in value.list_value.values)
    for name in ("team", "budget_window"):
        if (value := _metadata(metadata, name)) is not None:
            setattr(principal, name, value.string_value)
    for name in ("requests_per_minute", "tokens_per_minute", "budget_usd"):
        if (value := _metadata(metadata, name)) is not None:
            setattr(principal, name, value.number_value)
    if (value := _metadata(metadata, "models")) is not None:
        principal.models.extend(item.string_value for item in value.list_value.values)
    return verdict


class EnvoyAuthzClient:
    """The `Auth` interface, answered by an ext_authz service the team already runs."""

    def __init__(self, channel: grpc.Channel, tenant_header: str = TENANT_HEADER) -> None:
        self._stub = external_auth_pb2_grpc.AuthorizationStub(channel)
        self.tenant_header = tenant_header

    def check(self, credentials: Sequence[str], options: CallOptions = NO_OPTIONS) -> list[CheckVerdict]:
        """One Check per distinct credential, all sent before the first answer is awaited."""
        calls: dict[str, Any] = {}
        for credential in credentials:
            if credential not in calls:
                calls[credential] = self._stub.Check.future(check_request_for(credential), timeout=options.timeout,
                                                            metadata=tuple(options.metadata) or None)
        try:
            verdicts = {credential: verdict_from(call.result(), self.tenant_header)
                        for credential, call in calls.items()}
        except grpc.RpcError:
            for call in calls.values():
                call.cancel()
            raise
        return [verdicts[credential] for credential in credentials]
