"""`python -m spine.tools.healthcheck [ADDRESS]`: the image's HEALTHCHECK — grpc.health.v1 asked once.

It asks the plaintext probe port (`--probe-listen`, as Kubernetes' grpc probes do) at ADDRESS,
or at $SPINE_PROBE_ADDRESS (the image sets 127.0.0.1:50080, the manifests' probe port), and
exits 0 when the answer is SERVING, 1 otherwise, within a two-second budget. It imports grpc
and the health stubs alone (not the runtime: ~2 s of imports, on every check).
"""

from __future__ import annotations

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    address = args[0] if args else os.environ.get("SPINE_PROBE_ADDRESS", "127.0.0.1:50080")
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2.0)
        except grpc.RpcError as error:
            print(f"{address}: no answer ({error.code().name})")
            return 1
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    print(f"{address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
