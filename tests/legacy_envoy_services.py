"""A stand-in for a team's existing services: ext_authz and a rate limit service, Envoy's protocols only.

    python tests/legacy_envoy_services.py --key legacy-key-1=acme --limit 3 --window-s 60

It imports nothing from spine (only grpcio and the Envoy protos of xds-protos), the way a
service written by another team would not. `Authorization.Check` accepts `authorization:
Bearer KEY` for a known key and names the tenant in `--tenant-header`; `--forbid KEY` is a
known key that is denied 403. `ShouldRateLimit` counts hits per descriptor in fixed windows
(`--limit` per `--window-s`) in `--domain`, like envoyproxy/ratelimit: past the limit
OVER_LIMIT with the time left in the window. It prints `listening on HOST:PORT` once serving.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from concurrent import futures

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.auth.v3 import external_auth_pb2, external_auth_pb2_grpc
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import duration_pb2
from google.rpc import status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc


class LegacyAuthz(external_auth_pb2_grpc.AuthorizationServicer):
    def __init__(self, keys: dict[str, str], forbidden: set[str], tenant_header: str) -> None:
        self.keys = keys
        self.forbidden = forbidden
        self.tenant_header = tenant_header

    def Check(self, request: external_auth_pb2.CheckRequest, context: object) -> external_auth_pb2.CheckResponse:
        value = request.attributes.request.http.headers.get("authorization", "")
        key = value[7:] if value.startswith("Bearer ") else ""
        if key in self.forbidden:
            return self._deny(7, http_status_pb2.Forbidden, "legacy: this key may not call the model")
        tenant = self.keys.get(key)
        if tenant is None:
            return self._deny(16, http_status_pb2.Unauthorized, "legacy: unknown key")
        return external_auth_pb2.CheckResponse(
            status=status_pb2.Status(code=0),
            ok_response=external_auth_pb2.OkHttpResponse(headers=[
                base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=self.tenant_header, value=tenant))]))

    @staticmethod
    def _deny(code: int, http: int, reason: str) -> external_auth_pb2.CheckResponse:
        return external_auth_pb2.CheckResponse(
            status=status_pb2.Status(code=code, message=reason),
            denied_response=external_auth_pb2.DeniedHttpResponse(status=http_status_pb2.HttpStatus(code=http),
                                                                  body=reason))


class LegacyRateLimit(rls_pb2_grpc.RateLimitServiceServicer):
    def __init__(self, domain: str, limit: int, window_s: float) -> None:
        self.domain = domain
        self.limit = limit
        self.window_s = window_s
        self.counts: dict[tuple[int, tuple[tuple[str, str], ...]], int] = {}
        self.lock = threading.Lock()

    def ShouldRateLimit(self, request: rls_pb2.RateLimitRequest, context: object) -> rls_pb2.RateLimitResponse:
        Response = rls_pb2.RateLimitResponse
        if request.domain != self.domain:
            return Response(overall_code=Response.OK)  # no limits configured for that domain
        now = time.time()
        window = int(now // self.window_s)
        left = (window + 1) * self.window_s - now
        answer = Response(overall_code=Response.OK)
        with self.lock:
            for descriptor in request.descriptors:
                key = (window, tuple((e.key, e.value) for e in descriptor.entries))
                hits = descriptor.hits_addend.value if descriptor.HasField("hits_addend") else (request.hits_addend or 1)
                self.counts[key] = self.counts.get(key, 0) + hits
                over = self.counts[key] > self.limit
                status = answer.statuses.add(
                    code=Response.OVER_LIMIT if over else Response.OK,
                    current_limit=Response.RateLimit(name="legacy_per_tenant", requests_per_unit=self.limit,
                                                     unit=Response.RateLimit.MINUTE),
                    limit_remaining=max(0, self.limit - self.counts[key]),
                    duration_until_reset=duration_pb2.Duration(seconds=int(left), nanos=int(left % 1 * 1e9)))
                if status.code == Response.OVER_LIMIT:
                    answer.overall_code = Response.OVER_LIMIT
        return answer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--listen", default="127.0.0.1:0")
    parser.add_argument("--key", action="append", default=[], help="KEY=TENANT")
    parser.add_argument("--forbid", action="append", default=[], help="a known key denied 403")
    parser.add_argument("--tenant-header", default="x-legacy-tenant")
    parser.add_argument("--domain", default="legacy")
    parser.add_argument("--limit", type=int, default=3)
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--no-health", action="store_true", help="serve no grpc.health.v1 service")
    args = parser.parse_args()

    keys = dict(item.split("=", 1) for item in args.key)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    external_auth_pb2_grpc.add_AuthorizationServicer_to_server(
        LegacyAuthz(keys, set(args.forbid), args.tenant_header), server)
    rls_pb2_grpc.add_RateLimitServiceServicer_to_server(
        LegacyRateLimit(args.domain, args.limit, args.window_s), server)
    if not args.no_health:
        servicer = health.HealthServicer()
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port(args.listen)
    server.start()
    print(f"listening on {args.listen.rsplit(':', 1)[0]}:{port}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    server.stop(0.5).wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
