"""`python -m bench.leases_check`: the shared store's check across replicas, through the Gateway.

Three collapsed replicas (`spine up --layout collapsed`, three processes) share one Redis
(`ratelimit.store.redis.address`, everything else the defaults); one tenant is limited to
`--rate` requests/s (burst as much: 50 and 50) and sends ten times that (500/s) for
`--seconds` (10). Three runs, each after the buckets are full again:

1. **one**: every request to the first replica;
2. **spread**: round robin over the three;
3. **store stopped**: the Redis server killed, then round robin again: each replica falls
   back to its share (1 / the live replicas it last saw) and keeps answering.

Expected: about burst + rate x seconds (550) admitted in runs 1 and 2, at most that plus the
replicas' reserves; in run 3 each replica at most a third of it (plus a third of a burst it
may hold when the store goes). Requests are sent without waiting for answers (gRPC futures),
paced by the clock; `limit` is computed over the time the sending actually took. Also per
run: each replica's store calls a second and leased tokens (from its /metrics), and every
status code seen (anything but OK and RESOURCE_EXHAUSTED is a failure).

Writes `bench/leases_check.json` and prints a table. Not part of `make bench` (about a minute).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import yaml
from prometheus_client.parser import text_string_to_metric_families

from spine.tools.local_redis import LocalRedis
from wire.v1 import gateway_pb2_grpc, generation_pb2

KEY = "spine-dev-key-0000"  # the default config's dev tenant
READY_TIMEOUT_S = 120.0


def start_replicas(config: Path, workdir: Path, count: int) -> list[tuple[subprocess.Popen[str], dict[str, Any]]]:
    processes = [subprocess.Popen(
        [sys.executable, "-m", "spine", "--config", str(config), "up", "--layout", "collapsed",
         "--listen", "127.0.0.1:0", "--http-listen", "off", "--run-dir", str(workdir / f"replica{i}")],
        stdout=subprocess.PIPE, stderr=(workdir / f"replica{i}.log").open("w"), text=True)
        for i in range(count)]
    started = []
    for process in processes:
        assert process.stdout is not None
        line = process.stdout.readline()
        if not line:
            raise RuntimeError(f"a replica exited before it was ready; see {workdir}/replica*.log")
        started.append((process, json.loads(line)))
    return started


def store_state(metrics: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5) as answer:
        found = {f.name: f for f in text_string_to_metric_families(answer.read().decode())}

    def value(name: str, **labels: str) -> float:
        return float(next((s.value for s in found[name].samples if s.labels == labels
                           and not s.name.endswith("_created")), 0.0))

    return {"leasing": value("spine_ratelimit_store_leasing"), "replicas": value("spine_ratelimit_store_replicas"),
            "calls_ok": value("spine_ratelimit_store_calls", result="ok"),
            "calls_error": value("spine_ratelimit_store_calls", result="error"),
            "fallbacks": value("spine_ratelimit_store_fallbacks"),
            "leased_requests": value("spine_ratelimit_store_leased_tokens", resource="requests")}


def send(stubs: list[Any], rate: float, seconds: float, route: str) -> dict[str, Any]:
    """10 x `rate` requests a second for `seconds`, without waiting for answers."""
    request = generation_pb2.GenerateRequest(model="default", prompt="hi", max_tokens=1)
    metadata = [("authorization", f"Bearer {KEY}")]
    futures: list[tuple[int, Any]] = []
    start, sent = time.monotonic(), 0
    while (elapsed := time.monotonic() - start) < seconds:
        while sent < int(elapsed * 10 * rate):
            i = 0 if route == "one" else sent % len(stubs)
            futures.append((i, stubs[i].Generate.future(request, timeout=30.0, metadata=metadata)))
            sent += 1
        time.sleep(0.001)
    elapsed = time.monotonic() - start
    admitted = [0] * len(stubs)
    codes: Counter[str] = Counter()
    for i, future in futures:
        try:
            future.result()
            code = grpc.StatusCode.OK
        except grpc.RpcError as error:
            code = error.code()
        codes[code.name] += 1
        admitted[i] += code == grpc.StatusCode.OK
    return {"sent": sent, "seconds": elapsed, "admitted_per_replica": admitted, "admitted": sum(admitted),
            "codes": dict(codes)}


def run(rate: float, seconds: float, workdir: Path) -> dict[str, Any]:
    results: dict[str, Any] = {"rate": rate, "burst": rate, "seconds": seconds, "replicas": 3}
    with LocalRedis(workdir / "redis") as redis_server:
        config = workdir / "spine.yaml"
        config.write_text(yaml.safe_dump({"ratelimit": {
            "tenants": {"dev": {"requests_per_second": rate, "burst": rate}},
            "store": {"redis": {"address": redis_server.address}}}}))
        replicas = start_replicas(config, workdir, 3)
        channels = [grpc.insecure_channel(ready["address"]) for _, ready in replicas]
        stubs = [gateway_pb2_grpc.GatewayStub(channel) for channel in channels]
        metrics = [str(ready["metrics"]) for _, ready in replicas]
        results["health"] = [ready["health"]["components"]["ratelimit"]["reason"] for _, ready in replicas]
        try:
            for route in ("one", "spread", "store stopped"):
                time.sleep(2.0 + 1.0)  # the store's bucket full again, idle leases given back (lease_s)
                if route == "store stopped":
                    redis_server.stop()
                    time.sleep(1.0)  # every replica's renewal found it gone
                before = [store_state(m) for m in metrics]
                outcome = send(stubs, rate, seconds, "one" if route == "one" else "spread")
                after = [store_state(m) for m in metrics]
                outcome["limit"] = rate + rate * outcome["seconds"]
                outcome["admitted_vs_limit"] = outcome["admitted"] / outcome["limit"]
                outcome["store_calls_per_s_per_replica"] = [
                    (a["calls_ok"] + a["calls_error"] - b["calls_ok"] - b["calls_error"]) / outcome["seconds"]
                    for a, b in zip(after, before, strict=True)]
                outcome["store_after"] = after
                results[route] = outcome
        finally:
            for channel in channels:
                channel.close()
            for process, _ in replicas:
                process.send_signal(signal.SIGTERM)
            for process, _ in replicas:
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.kill(process.pid, signal.SIGKILL)
                    process.wait(timeout=10)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.leases_check", description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=50.0, help="the tenant's limit, requests/s (burst as much)")
    parser.add_argument("--seconds", type=float, default=10.0, help="each run")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("leases_check.json"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="spine-leases-check-") as workdir:
        results = run(args.rate, args.seconds, Path(workdir))
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    for route in ("one", "spread", "store stopped"):
        r = results[route]
        print(f"{route:>13}: sent {r['sent']} in {r['seconds']:.2f} s, admitted {r['admitted']} "
              f"{r['admitted_per_replica']} of a limit of {r['limit']:.0f} ({r['admitted_vs_limit']:.4f}); "
              f"codes {r['codes']}; store calls/s per replica "
              f"{[round(c, 1) for c in r['store_calls_per_s_per_replica']]}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
