"""The layered layout's cost per hop: one middleware process, called over its unix socket.

    python -m bench.hop [--components auth,router] [--calls 2000] [--rounds 5] [--tree DIR]

What the layered gateway pays for each middleware it reaches: one request's round trip to a
`runtime.process` child (`python -m runtime.process COMPONENT`, as `spine up --layout
layered` starts it), sequentially (c=1: p50 and p99 of the round trip, the child's CPU per
call from /proc) and from 16 calls in flight at once (one grpc.aio client: throughput and
the child's CPU per call). Beside them, the handler's own CPU: the servicer's method called
in this process, no server (what the hop adds is the round trip less that).

`--tree DIR` runs the child from another checkout of the repository (its `runtime.process`),
so two versions of the server are compared by the same client: an A/B of the process's
server against the one before it. Rounds alternate nothing; run the two trees back to back,
a few times, and compare medians (this host is shared: one run is noise).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from runtime.config.file import load_config
from runtime.processes.launch import REPO_ROOT, launch, serving_on
from services.registry import DEFAULT
from wire.v1 import auth_pb2, logs_pb2, router_pb2

DEV_KEY = "spine-dev-key-0000"  # the default config's development key
CONCURRENT = 16
TICKS = os.sysconf("SC_CLK_TCK")

# One request per component: what the layered gateway sends it for one client request.
REQUESTS: dict[str, tuple[str, Callable[[], Any]]] = {
    "auth": ("CheckBatch", lambda: auth_pb2.CheckBatchRequest(
        items=[auth_pb2.CheckRequest(credential=f"Bearer {DEV_KEY}")])),
    "router": ("ResolveBatch", lambda: router_pb2.ResolveBatchRequest(
        items=[router_pb2.ResolveRequest(model="tiny")])),
    "logs": ("AppendBatch", lambda: logs_pb2.AppendBatchRequest(records=[logs_pb2.LogRecord(
        request_id="bench", tenant="dev", model="tiny-lm", status="OK", latency_ms=1.0, layout="layered")])),
}


def cpu_s(pid: int) -> float:
    """The process's user + system CPU so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def handler_us(component: str, run_dir: Path) -> float:
    """The median CPU of the servicer's method alone, called in this process (µs)."""
    from monolith.device import DeviceContext

    servicer = DEFAULT[component].build(load_config(), DeviceContext(), run_dir)
    rpc, make = REQUESTS[component]
    method, request = getattr(servicer, rpc), make()
    try:
        times = timeit.repeat(lambda: method(request, None), number=200, repeat=7)
    finally:
        close = getattr(servicer, "close", None)
        if close is not None:
            close()
    return statistics.median(times) / 200 * 1e6


def sequential(stub: Any, rpc: str, request: Any, calls: int) -> list[float]:
    method = getattr(stub, rpc)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        method(request, timeout=10)
        times.append(time.perf_counter() - start)
    return times


async def in_flight(address: str, component: str, calls: int) -> float:
    """Seconds for `calls` calls, CONCURRENT at a time, from one grpc.aio client."""
    rpc, make = REQUESTS[component]
    async with grpc.aio.insecure_channel(address) as channel:
        method = getattr(DEFAULT[component].stub_class()(channel), rpc)
        request = make()
        await method(request, timeout=10)
        left = [calls]

        async def client() -> None:
            while left[0] > 0:
                left[0] -= 1
                await method(request, timeout=10)

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(CONCURRENT)))
        return time.perf_counter() - start


def measure(component: str, tree: Path, calls: int, rounds: int, run_dir: Path) -> dict[str, Any]:
    config = run_dir / "config.yaml"
    config.write_text(load_config().to_yaml())
    address = f"unix:{run_dir}/{component}.sock"
    env = {**os.environ, "PYTHONPATH": str(tree)}
    child = launch(component, [sys.executable, "-m", "runtime.process", component, "--listen", address,
                               "--config", str(config), "--run-dir", str(run_dir)],
                   log_path=run_dir / f"{component}.log", cwd=tree, env=env)
    try:
        child.wait_ready(120, serving_on)
        rpc, make = REQUESTS[component]
        figures: dict[str, list[float]] = {"p50_us": [], "p99_us": [], "cpu_us_c1": [], "rps_c16": [],
                                           "cpu_us_c16": []}
        with grpc.insecure_channel(address) as channel:
            stub = DEFAULT[component].stub_class()(channel)
            sequential(stub, rpc, make(), 200)  # warm: connection, caches, the pool's threads
            for _ in range(rounds):
                before = cpu_s(child.pid)
                times = sorted(sequential(stub, rpc, make(), calls))
                figures["cpu_us_c1"].append((cpu_s(child.pid) - before) / calls * 1e6)
                figures["p50_us"].append(times[len(times) // 2] * 1e6)
                figures["p99_us"].append(times[int(len(times) * 0.99)] * 1e6)
                before = cpu_s(child.pid)
                took = asyncio.run(in_flight(address, component, calls))
                figures["cpu_us_c16"].append((cpu_s(child.pid) - before) / calls * 1e6)
                figures["rps_c16"].append(calls / took)
        threads = len(os.listdir(f"/proc/{child.pid}/task"))
    finally:
        child.stop(30)
    return {"rpc": rpc, "threads_after": threads, "rounds": figures,
            **{name: round(statistics.median(values), 1) for name, values in figures.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hop", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--components", default="auth,router", help=f"comma-separated, of {', '.join(REQUESTS)}")
    parser.add_argument("--calls", type=int, default=2000, help="calls per round and mode")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tree", type=Path, default=REPO_ROOT, help="the checkout whose runtime.process serves")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    components = [name.strip() for name in args.components.split(",") if name.strip()]
    unknown = [name for name in components if name not in REQUESTS]
    if unknown:
        parser.error(f"--components: unknown {', '.join(unknown)}; known: {', '.join(REQUESTS)}")
    results: dict[str, Any] = {"tree": str(args.tree), "calls": args.calls, "rounds": args.rounds}
    for component in components:
        with tempfile.TemporaryDirectory(prefix=f"spine-hop-{component}-", dir="/tmp") as tmp:
            figures = measure(component, args.tree, args.calls, args.rounds, Path(tmp))
            figures["handler_us"] = round(handler_us(component, Path(tmp)), 1)
        results[component] = figures
        print(f"{component:>7} {figures['rpc']:<13} handler {figures['handler_us']:6.1f} µs | c=1 p50 "
              f"{figures['p50_us']:6.0f} µs p99 {figures['p99_us']:6.0f} µs, child CPU {figures['cpu_us_c1']:5.0f} µs"
              f"/call | c={CONCURRENT} {figures['rps_c16']:6.0f} calls/s, child CPU {figures['cpu_us_c16']:5.0f} "
              f"µs/call | {figures['threads_after']} threads", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
