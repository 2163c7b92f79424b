"""What the *calling* side pays for remote middlewares: sync stubs on a handler thread, or
grpc.aio stubs awaited on the HTTP loop.

    python -m bench.caller_hops [--hops 5] [--requests 1500] [--rounds 5] [--concurrency 1,16]

The layered gateway (and a spine in mid-migration whose steps are partly in other processes)
serves an HTTP request by handing it from the HTTP loop to a handler thread, which makes the
request's middleware calls with sync gRPC stubs, one after the other, and hands the answer
back to the loop. The alternative is to await grpc.aio stubs on the HTTP loop itself, with
no handler thread. Which costs the caller less is a property of gRPC Python, so it is
measured here on its own, with everything else taken out: one middleware process (auth,
`python -m runtime.process auth` on its unix socket, as `spine up --layout layered` starts
it), and one "request" = `--hops` `CheckBatch` calls in a row, the way a layered request
reaches auth, the router, the rate limiter, the cache and the logs in turn.

Both paths run in this process on one uvloop loop (the HTTP server's), taking turns round by
round: `thread` (`run_in_executor` to a pool whose thread makes the hops with a sync stub, as
`runtime/http/app.py` runs the layered gateway) and `loop` (the hops awaited on a grpc.aio
channel). Printed per path and concurrency: p50 and p99 of a request, requests per second,
this process's CPU per request (the caller's share: what the gateway would pay) and the
child's. A request's hops per thread switch is what differs, so `--hops 1` and `--hops 5` say
whether the difference is per request (the hand-off) or per hop (each call's completion).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import uvloop

from bench.hop import cpu_s
from runtime.config.file import load_config
from runtime.processes.launch import launch, serving_on
from services.pipeline.loop_bridge import run_on_loop, wait_for
from services.registry import DEFAULT
from wire.v1 import auth_pb2

DEV_KEY = "spine-dev-key-0000"  # the default config's development key
PATHS = ("thread", "loop", "bridged")


def _request() -> auth_pb2.CheckBatchRequest:
    return auth_pb2.CheckBatchRequest(items=[auth_pb2.CheckRequest(credential=f"Bearer {DEV_KEY}")])


class Caller:
    """Both paths' clients, made on the loop that runs them."""

    def __init__(self, address: str, hops: int, threads: int) -> None:
        self.hops = hops
        self.request = _request()
        self.sync_channel = grpc.insecure_channel(address)
        self.sync_check = DEFAULT["auth"].stub_class()(self.sync_channel).CheckBatch
        self.aio_channel = grpc.aio.insecure_channel(address)
        self.aio_check = DEFAULT["auth"].stub_class()(self.aio_channel).CheckBatch
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="handler")

    def _hops_on_thread(self) -> None:
        for _ in range(self.hops):
            self.sync_check(self.request, timeout=10)

    async def thread(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self.pool, self._hops_on_thread)

    async def loop(self) -> None:
        for _ in range(self.hops):
            await self.aio_check(self.request, timeout=10)

    def _hops_bridged(self) -> None:
        for _ in range(self.hops):
            wait_for(self.aio_check(self.request, timeout=10))

    async def bridged(self) -> None:
        await run_on_loop(self._hops_bridged)

    async def close(self) -> None:
        await self.aio_channel.close(None)
        self.sync_channel.close()
        self.pool.shutdown()


async def _turn(one: Callable[[], Any], requests: int, concurrency: int) -> tuple[list[float], float]:
    """Each request's seconds, and the turn's wall seconds."""
    times: list[float] = []
    left = [requests]

    async def client() -> None:
        while left[0] > 0:
            left[0] -= 1
            start = time.perf_counter()
            await one()
            times.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return times, time.perf_counter() - start


async def _measure(address: str, child_pid: int, hops: int, requests: int, rounds: int,
                   concurrencies: list[int]) -> dict[str, Any]:
    caller = Caller(address, hops, threads=max(concurrencies))
    figures: dict[str, Any] = {}
    try:
        for path in PATHS:  # warm both: connections, the pool's threads
            await _turn(getattr(caller, path), 200, max(concurrencies))
        for concurrency in concurrencies:
            cell: dict[str, dict[str, list[float]]] = {
                path: {"p50_us": [], "p99_us": [], "rps": [], "caller_cpu_us": [], "child_cpu_us": []}
                for path in PATHS}
            for round_ in range(rounds):
                order = PATHS[round_ % len(PATHS):] + PATHS[:round_ % len(PATHS)]
                for path in order:
                    # This process's CPU to the nanosecond; the child's from /proc, in clock ticks.
                    caller_before, child_before = time.process_time(), cpu_s(child_pid)
                    times, wall = await _turn(getattr(caller, path), requests, concurrency)
                    caller_after, child_after = time.process_time(), cpu_s(child_pid)
                    times.sort()
                    figures_of = cell[path]
                    figures_of["p50_us"].append(times[len(times) // 2] * 1e6)
                    figures_of["p99_us"].append(times[int(len(times) * 0.99)] * 1e6)
                    figures_of["rps"].append(requests / wall)
                    figures_of["caller_cpu_us"].append((caller_after - caller_before) / requests * 1e6)
                    figures_of["child_cpu_us"].append((child_after - child_before) / requests * 1e6)
            figures[f"c={concurrency}"] = {
                path: {"rounds": values, **{name: round(statistics.median(v), 1) for name, v in values.items()}}
                for path, values in cell.items()}
    finally:
        await caller.close()
    return figures


def measure(hops: int, requests: int, rounds: int, concurrencies: list[int], run_dir: Path) -> dict[str, Any]:
    config = run_dir / "config.yaml"
    config.write_text(load_config().to_yaml())
    address = f"unix:{run_dir}/auth.sock"
    child = launch("auth", [sys.executable, "-m", "runtime.process", "auth", "--listen", address,
                            "--config", str(config), "--run-dir", str(run_dir)],
                   log_path=run_dir / "auth.log")
    try:
        child.wait_ready(120, serving_on)
        return uvloop.run(_measure(address, child.pid, hops, requests, rounds, concurrencies))
    finally:
        child.stop(30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.caller_hops", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hops", type=int, default=5, help="middleware calls per request")
    parser.add_argument("--requests", type=int, default=1500, help="requests per round and path")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", default="1,16", help="comma-separated")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.hops < 1 or args.requests < 10 or args.rounds < 1:
        parser.error("--hops must be at least 1, --requests at least 10, --rounds at least 1")
    try:
        concurrencies = [int(value) for value in args.concurrency.split(",") if value.strip()]
    except ValueError:
        parser.error(f"--concurrency: comma-separated integers, got {args.concurrency!r}")
    if not concurrencies or min(concurrencies) < 1:
        parser.error("--concurrency: at least one, each at least 1")
    with tempfile.TemporaryDirectory(prefix="spine-caller-hops-", dir="/tmp") as tmp:
        figures = measure(args.hops, args.requests, args.rounds, concurrencies, Path(tmp))
    for cell, paths in figures.items():
        for path, values in paths.items():
            print(f"{cell:>5} {path:<6} p50 {values['p50_us']:7.0f} µs  p99 {values['p99_us']:7.0f} µs  "
                  f"{values['rps']:6.0f} req/s  caller CPU {values['caller_cpu_us']:6.0f} µs/req  "
                  f"child CPU {values['child_cpu_us']:6.0f} µs/req", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"hops": args.hops, "requests": args.requests, "rounds": args.rounds,
                                         "cells": figures}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
