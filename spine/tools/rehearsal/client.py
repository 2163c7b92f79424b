"""A proxyless gRPC data plane for the rehearsal: a stock client on `xds:///spine-gateway`.

    GRPC_XDS_BOOTSTRAP_CONFIG='{...}' python -m spine.tools.rehearsal.client --token KEY [--rate 10]

Nothing but grpcio and the Gateway stubs: gRPC reads the bootstrap from the environment (the
controller's ADS address and this data plane's node id), follows LDS → RDS → CDS → EDS and
picks a side per request by the route's weights, as any proxyless client in production would.

One setting differs from gRPC's defaults: the reconnect backoff is capped at 1 s
(`--max-reconnect-backoff-ms`). With the default (growing with the downtime, up to 120 s) a
backend restarted at the same address stays unpicked for seconds after it is back: requests
routed to its cluster meanwhile fail UNAVAILABLE on the client, where no server-side gate sees
them (deploy/RUNBOOK.md, "Before the first stage").

It sends greedy `Generate` calls with fresh prompts at a bounded rate (`--rate` per second,
over `--concurrency` threads) until its standard input closes or `--duration-s` passes.
Every line it reads is a command: `counts` prints one JSON line with what it has seen so
far — status codes, and the `x-spine-layout` each answer carried (`layered`, or the spine's
`mixed`/`collapsed`; `unanswered` when no gateway answered) — `stop` (or end of input) stops it, printing the final counts.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections import Counter
from typing import Any

import grpc

from wire.v1 import gateway_pb2_grpc, generation_pb2

XDS_TARGET = "xds:///spine-gateway"


class DataPlane:
    def __init__(self, token: str, rate: float, concurrency: int, max_tokens: int, duration_s: float,
                 prefix: str, target: str = XDS_TARGET, timeout_s: float = 10.0,
                 max_reconnect_backoff_ms: int = 1000) -> None:
        options = [] if max_reconnect_backoff_ms <= 0 else [
            ("grpc.initial_reconnect_backoff_ms", min(100, max_reconnect_backoff_ms)),
            ("grpc.max_reconnect_backoff_ms", max_reconnect_backoff_ms)]
        self.channel = grpc.insecure_channel(target, options=options)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)
        self.token = token
        self.interval = 1.0 / rate if rate > 0 else 0.0
        self.max_tokens = max_tokens
        self.deadline = time.monotonic() + duration_s
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.codes: Counter[str] = Counter()
        self.layouts: Counter[str] = Counter()
        self.errors: list[str] = []  # the first few non-OK answers, for whoever reads the counts
        self.sent = 0
        self._next = time.monotonic()
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(max(1, concurrency))]

    def start(self) -> DataPlane:
        for thread in self.threads:
            thread.start()
        return self

    def _slot(self) -> int | None:
        """The next request's number, once its turn under the rate has come (None: stop)."""
        with self.lock:
            number = self.sent
            self.sent += 1
            at = self._next = max(self._next + self.interval, time.monotonic())
        while True:
            now = time.monotonic()
            if self.stop.is_set() or now >= self.deadline:
                return None
            if now >= at:
                return number
            self.stop.wait(min(at - now, 0.2))

    def _loop(self) -> None:
        while (number := self._slot()) is not None:
            request = generation_pb2.GenerateRequest(model="tiny-lm", prompt=f"{self.prefix} request {number}",
                                                     max_tokens=self.max_tokens)
            layout = ""
            try:
                _, call = self.stub.Generate.with_call(request, metadata=[("authorization", f"Bearer {self.token}")],
                                                       timeout=self.timeout_s)
                code = "OK"
                layout = _layout(call.trailing_metadata())
            except grpc.RpcError as error:
                code = error.code().name
                layout = _layout(error.trailing_metadata())
                with self.lock:
                    if len(self.errors) < 5:
                        self.errors.append(f"{code}: {error.details()}")
            with self.lock:
                self.codes[code] += 1
                self.layouts[layout or "unanswered"] += 1

    def counts(self) -> dict[str, Any]:
        with self.lock:
            return {"codes": dict(self.codes), "layouts": dict(self.layouts), "errors": list(self.errors)}

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=self.timeout_s + 1)
        self.channel.close()


def _layout(trailing: Any) -> str:
    """The `x-spine-layout` a gateway put in the trailing metadata ("" when none answered)."""
    return next((str(value) for key, value in trailing or () if key == "x-spine-layout"), "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spine.tools.rehearsal.client", description=__doc__.splitlines()[0])
    parser.add_argument("--token", required=True, help="the API key sent as the bearer credential")
    parser.add_argument("--rate", type=float, default=10.0, help="requests per second, at most (0: unpaced)")
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=2)
    parser.add_argument("--duration-s", type=float, default=600.0, help="stop sending after this long regardless")
    parser.add_argument("--prefix", default="rehearsal", help="prompts are '<prefix> request <n>' (all distinct)")
    parser.add_argument("--target", default=XDS_TARGET)
    parser.add_argument("--max-reconnect-backoff-ms", type=int, default=1000,
                        help="gRPC's reconnect backoff cap (0: gRPC's default, up to 120 s): a backend restarted "
                             "at the same address is reached again within this long")
    args = parser.parse_args(argv)
    plane = DataPlane(args.token, args.rate, args.concurrency, args.max_tokens, args.duration_s, args.prefix,
                      args.target, max_reconnect_backoff_ms=args.max_reconnect_backoff_ms).start()
    try:
        for line in sys.stdin:
            if line.strip() == "counts":
                print(json.dumps(plane.counts()), flush=True)
            elif line.strip() == "stop":
                break
    finally:
        plane.close()
        print(json.dumps(plane.counts()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
