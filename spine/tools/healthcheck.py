"""`python -m spine.tools.healthcheck [ADDRESS]`: the image's HEALTHCHECK — grpc.health.v1 asked once.

It asks the plaintext probe port (`--probe-listen`, as Kubernetes' grpc probes do) at ADDRESS,
or at $SPINE_PROBE_ADDRESS (the image sets 127.0.0.1:50080, the manifests' probe port), and
exits 0 when the answer is SERVING, 1 otherwise, within a two-second budget.
"""

from __future__ import annotations

import os
import sys

import grpc

from runtime.health import check_serving


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    address = args[0] if args else os.environ.get("SPINE_PROBE_ADDRESS", "127.0.0.1:50080")
    with grpc.insecure_channel(address) as channel:
        serving = check_serving(channel, timeout=2.0)
    print(f"{address}: {'SERVING' if serving else 'not serving' if serving is False else 'no answer'}")
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
