"""Where queued requests wait: the inference priority queue or gRPC's FIFO of handler threads.

`python -m bench.admission` starts a collapsed stack, queues N throughput-class (priority −1)
requests through the Gateway, then times one latency-class (priority 1) request behind them,
and floods past `inference.max_queue` to see whether RESOURCE_EXHAUSTED with `retry-after`
comes back. It prints one JSON object: the priority-1 latency, what the server's load
header said, how many refusals and with what trailers, and the process's thread count.
Not part of `make bench`; run it by hand when the server's threading changes.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from services.inference_load import LOAD_HEADER, parse_load
from spine.runtime.config import load_config, merge, placements_for
from spine.runtime.stack import Stack
from spine.v1 import gateway_pb2_grpc, generation_pb2

KEY = "bench-admission-key-0000"
OVERRIDES: dict[str, Any] = {
    "auth": {"api_keys": [{"id": "bench", "tenant": "bench", "key": KEY, "scopes": ["generate"],
                           "max_priority": 1}]},
    "ratelimit": {"default": {"requests_per_second": 100_000, "burst": 100_000,
                              "tokens_per_minute": 100_000_000, "token_burst": 100_000_000}},
}


def _request(prompt: str, max_tokens: int, priority: int) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(model="tiny-lm", prompt=prompt, max_tokens=max_tokens,
                                          priority=priority)


def measure(queued: int = 200, max_tokens: int = 64, flood: int = 0, extra: dict[str, Any] | None = None,
            settle_s: float = 2.0) -> dict[str, Any]:
    """Queue `queued` priority −1 requests, then time a priority-1 one; optionally flood."""
    config = load_config(overrides=merge(OVERRIDES, extra or {}))
    with tempfile.TemporaryDirectory(prefix="spine-admission-") as tmp:
        stack = Stack(config, placements_for("collapsed", config), run_dir=Path(tmp))
        stack.start()
        channel = grpc.insecure_channel(stack.address)
        stub = gateway_pb2_grpc.GatewayStub(channel)
        metadata = (("authorization", f"Bearer {KEY}"),)
        try:
            stub.Generate(_request("warm up", 4, 0), metadata=metadata, timeout=30)
            background = [stub.Generate.future(_request(f"background {i:05d}", max_tokens, -1),
                                               metadata=metadata, timeout=300) for i in range(queued)]
            time.sleep(settle_s)  # every background request has reached its wait
            inference = stack.local_servicers["inference"]
            server_queue = inference.scheduler.queue_depth
            started = time.perf_counter()
            response, call = stub.Generate.with_call(_request("urgent", 8, 1), metadata=metadata, timeout=60)
            urgent_s = time.perf_counter() - started
            load = parse_load(dict(call.trailing_metadata()).get(LOAD_HEADER))
            threads = threading.active_count()
            refusals: list[dict[str, str]] = []
            if flood:
                floods = [stub.Generate.future(_request(f"flood {i:05d}", max_tokens, 0), metadata=metadata,
                                               timeout=300) for i in range(flood)]
                for future in floods:
                    try:
                        future.result()
                    except grpc.RpcError as error:
                        failed_call: Any = error  # a grpc.Call too
                        trailing = {str(k): str(v) for k, v in failed_call.trailing_metadata() or ()}
                        refusals.append({"code": failed_call.code().name, "details": str(failed_call.details()),
                                         "retry-after": trailing.get("retry-after", "")})
            failed = 0
            for future in background:
                try:
                    future.result()
                except grpc.RpcError:
                    failed += 1
            return {
                "queued": queued, "max_tokens": max_tokens, "urgent_ms": round(urgent_s * 1000.0, 1),
                "urgent_tokens": response.completion_tokens, "server_queue_before_urgent": server_queue,
                "load_header_on_urgent": load, "threads_while_queued": threads,
                "background_failed": failed, "flood": flood, "refused": len(refusals),
                "refusal_codes": sorted({r["code"] for r in refusals}),
                "refusal_sample": refusals[:2],
            }
        finally:
            channel.close()
            stack.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queued", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--flood", type=int, default=0, help="more requests past the queue, to reach max_queue")
    parser.add_argument("--max-queue", type=int, default=None)
    args = parser.parse_args()
    extra = {"inference": {"max_queue": args.max_queue}} if args.max_queue else {}
    print(json.dumps(measure(args.queued, args.max_tokens, args.flood, extra), indent=1))


if __name__ == "__main__":
    main()
