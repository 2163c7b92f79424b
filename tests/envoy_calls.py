"""Envoy's side of the calls, as its ext_authz and ratelimit filters make them (for the tests)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2 as descriptor_pb2
from envoy.service.auth.v3 import attribute_context_pb2, external_auth_pb2, external_auth_pb2_grpc
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from google.protobuf import wrappers_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

AUTHZ = "envoy.service.auth.v3.Authorization"
RLS = "envoy.service.ratelimit.v3.RateLimitService"
OK = rls_pb2.RateLimitResponse.OK
OVER_LIMIT = rls_pb2.RateLimitResponse.OVER_LIMIT
UNKNOWN = rls_pb2.RateLimitResponse.UNKNOWN
LEGACY = Path(__file__).resolve().parent / "legacy_envoy_services.py"
# The config section that gives a spine or gateway its Envoy API listener (none by default).
ENVOY_LISTENER = {"listen": "127.0.0.1:0"}


def envoy_address(stack: Any) -> str:
    """Where a running stack answers Envoy's APIs (its `envoy_api.listen`)."""
    assert stack.envoy_server is not None, "the stack was started without envoy_api.listen"
    return str(stack.envoy_server.address)


def check_request(headers: dict[str, str] | None = None,
                  header_map: Sequence[tuple[str, str | bytes]] = ()) -> external_auth_pb2.CheckRequest:
    http = attribute_context_pb2.AttributeContext.HttpRequest(method="POST", path="/spine.v1.Gateway/Generate",
                                                              headers=headers or {})
    for key, value in header_map:
        if isinstance(value, bytes):
            http.header_map.headers.add(key=key, raw_value=value)
        else:
            http.header_map.headers.add(key=key, value=value)
    return external_auth_pb2.CheckRequest(attributes=attribute_context_pb2.AttributeContext(
        request=attribute_context_pb2.AttributeContext.Request(http=http)))


def check(channel: grpc.Channel, headers: dict[str, str] | None = None,
          header_map: Sequence[tuple[str, str | bytes]] = ()) -> external_auth_pb2.CheckResponse:
    return external_auth_pb2_grpc.AuthorizationStub(channel).Check(check_request(headers, header_map), timeout=10)


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def ok_headers(response: external_auth_pb2.CheckResponse) -> dict[str, base_pb2.HeaderValueOption]:
    return {option.header.key: option for option in response.ok_response.headers}


def descriptor(*entries: tuple[str, str], hits: int | None = None) -> descriptor_pb2.RateLimitDescriptor:
    out = descriptor_pb2.RateLimitDescriptor(
        entries=[descriptor_pb2.RateLimitDescriptor.Entry(key=k, value=v) for k, v in entries])
    if hits is not None:
        out.hits_addend.CopyFrom(wrappers_pb2.UInt64Value(value=hits))
    return out


def should_rate_limit(channel: grpc.Channel, descriptors: Sequence[descriptor_pb2.RateLimitDescriptor],
                      domain: str = "spine", hits_addend: int = 0) -> rls_pb2.RateLimitResponse:
    request = rls_pb2.RateLimitRequest(domain=domain, descriptors=descriptors, hits_addend=hits_addend)
    return rls_pb2_grpc.RateLimitServiceStub(channel).ShouldRateLimit(request, timeout=10)


def tenant_limit(channel: grpc.Channel, tenant: str, **kwargs: Any) -> rls_pb2.RateLimitResponse:
    """What Envoy's filter sends for a request of `tenant` (the tenant descriptor, cost 1)."""
    return should_rate_limit(channel, [descriptor(("tenant", tenant))], **kwargs)


def error_of(response: rls_pb2.RateLimitResponse) -> str:
    fields = response.dynamic_metadata.fields
    return fields["error"].string_value if "error" in fields else ""


def services(channel: grpc.Channel) -> set[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    return {service.name for reply in replies for service in reply.list_services_response.service}


@contextlib.contextmanager
def legacy_services(*args: str) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """`tests/legacy_envoy_services.py` in its own process: (address, process)."""
    process = subprocess.Popen([sys.executable, str(LEGACY), *args], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("listening on "), f"the legacy services did not start: {line!r}"
        yield line.split()[-1], process
    finally:
        process.terminate()
        process.wait(timeout=10)
