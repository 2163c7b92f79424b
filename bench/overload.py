"""The spine overloaded, in numbers: where requests wait, whether streams and budgets hold.

    python -m bench.overload priority [--queued 200] [--flood 200]
    python -m bench.overload streams  [--total 1000] [--concurrency 128]
    python -m bench.overload budget   [--total 400] [--concurrency 64]
    ... [--layout collapsed|layered] [--burn N]

The server runs in its own process(es) (`bench.targets.launch`), so this client never
shares its GIL. `--burn N` runs N busy-looping processes alongside, for a host under load
(the 1-minute load average seen during the run is reported). One JSON object on stdout.

* priority: queue `--queued` throughput-class (−1) requests, then time a latency-class (1)
  one behind them (the issue: under 1 s); optionally `--flood` more, to reach
  `inference.max_queue`: the refusals, their codes and `retry-after`.
* streams: `--total` full-speed streams, `--concurrency` at a time; how many were stopped.
* budget: `--total` valid unary requests for 256 tokens with the default compute budget;
  how many failed, and with what.

Not part of `make bench`: run it by hand when serving under load changes.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import psutil

from bench.targets import Target, launch
from runtime.config.file import load_config, merge
from runtime.processes.parent import spawn
from services.inference.load_hints import LOAD_HEADER, parse_load
from wire.v1 import gateway_pb2_grpc, generation_pb2

KEY = "spine-dev-key-0000"
METADATA = (("authorization", f"Bearer {KEY}"),)
UNLIMITED: dict[str, Any] = {"ratelimit": {"default": {
    "requests_per_second": 100_000, "burst": 100_000, "tokens_per_minute": 1.0e9, "token_burst": 1.0e9}}}


def _long(index: int) -> str:
    """Distinct prompts (no cache hits) whose greedy answers mostly run the full 256 tokens."""
    return f"a long greedy answer for collapsed {index}"


def _request(prompt: str, max_tokens: int, priority: int = 0) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(model="tiny-lm", prompt=prompt, max_tokens=max_tokens,
                                          priority=priority)


@contextmanager
def served(layout: str, extra: dict[str, Any]) -> Iterator[tuple[Any, Target]]:
    """A Gateway stub to `layout` running in its own process(es), and the target."""
    with tempfile.TemporaryDirectory(prefix="spine-overload-") as tmp:
        config_path = Path(tmp) / "config.yaml"
        config_path.write_text(load_config(overrides=merge(UNLIMITED, extra)).to_yaml())
        target = launch(layout, Path(tmp), config_path)
        try:
            address = target.wait_ready(120.0)
            with grpc.insecure_channel(address) as channel:
                stub = gateway_pb2_grpc.GatewayStub(channel)
                stub.Generate(_request("warm up", 4), metadata=METADATA, timeout=60)
                yield stub, target
        finally:
            target.stop()


# A busy loop that ends with this process (`runtime.processes.parent`: no fork hook).
BURN = "from runtime.processes.parent import follow_parent\nif follow_parent():\n    while True: pass"


@contextmanager
def burning(count: int) -> Iterator[Callable[[], float]]:
    """`count` busy-looping processes; yields a reader of the highest load average seen."""
    burners = [spawn([sys.executable, "-c", BURN]) for _ in range(count)]
    peak = [os.getloadavg()[0]]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(1.0):
            peak[0] = max(peak[0], os.getloadavg()[0])

    threading.Thread(target=sample, daemon=True).start()
    try:
        yield lambda: round(max(peak[0], os.getloadavg()[0]), 1)
    finally:
        done.set()
        for burner in burners:
            burner.kill()
            burner.wait()


def _footprint(target: Target) -> dict[str, float]:
    """Threads and resident memory of the target's processes, now."""
    threads = 0
    for process in target.tree():
        try:
            threads += process.num_threads()
        except psutil.Error:
            continue
    return {"threads": threads, "rss_mb": round(target.tree_rss_bytes() / (1 << 20), 1)}


def _error(error: grpc.RpcError) -> tuple[str, str, dict[str, str]]:
    call: Any = error  # a grpc.Call too
    return call.code().name, str(call.details()), {str(k): str(v) for k, v in call.trailing_metadata() or ()}


def priority(stub: Any, target: Target, queued: int, max_tokens: int, flood: int,
             settle_s: float) -> dict[str, Any]:
    background = [stub.Generate.future(_request(f"queued {i:05d} {_long(i)}", max_tokens, -1), metadata=METADATA,
                                       timeout=600) for i in range(queued)]
    time.sleep(settle_s)  # every one of them has reached the server and waits
    footprint = _footprint(target)
    started = time.perf_counter()
    response, call = stub.Generate.with_call(_request("urgent", 8, 1), metadata=METADATA, timeout=120)
    urgent_ms = (time.perf_counter() - started) * 1000.0
    load = parse_load(dict(call.trailing_metadata()).get(LOAD_HEADER))
    refusals: list[tuple[str, str, dict[str, str]]] = []
    floods = [stub.Generate.future(_request(f"flood {i:05d}", max_tokens), metadata=METADATA, timeout=600)
              for i in range(flood)]
    for future in floods:
        try:
            future.result()
        except grpc.RpcError as error:
            refusals.append(_error(error))
    for future in background:
        future.cancel()
    return {"queued": queued, "urgent_ms": round(urgent_ms, 1), "urgent_tokens": response.completion_tokens,
            "load_header_on_urgent": load, "server_while_queued": footprint, "flood": flood, "refused": len(refusals),
            "refusal_codes": dict(collections.Counter(code for code, _, _ in refusals)),
            "refusals_with_retry_after": sum("retry-after" in trailing for _, _, trailing in refusals),
            "refusal_samples": {code: {"details": d, "retry-after": t.get("retry-after")}
                                for code, d, t in reversed(refusals)}}


def _pool(total: int, concurrency: int, one: Callable[[int], tuple[str, int]]) -> dict[str, Any]:
    """`total` calls of `one(index)` -> (outcome, tokens received), `concurrency` at a time;
    outcomes counted by kind, tokens per second over the whole run."""
    outcomes: collections.Counter[str] = collections.Counter()
    tokens = [0]
    samples: dict[str, str] = {}
    lock = threading.Lock()
    next_index = iter(range(total))

    def worker() -> None:
        while True:
            with lock:
                index = next(next_index, None)
            if index is None:
                return
            outcome, received = one(index)
            kind = outcome.split(":", 1)[0]
            with lock:
                tokens[0] += received
                outcomes[kind] += 1
                samples.setdefault(kind, outcome)

    workers = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    started = time.perf_counter()
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    wall_s = time.perf_counter() - started
    return {"total": total, "concurrency": concurrency, "wall_s": round(wall_s, 1), "tokens": tokens[0],
            "tokens_per_s": round(tokens[0] / wall_s), "outcomes": dict(outcomes),
            "samples": {k: v for k, v in samples.items() if k != "OK"}}


def streams(stub: Any, total: int, concurrency: int, max_tokens: int) -> dict[str, Any]:
    def one(index: int) -> tuple[str, int]:
        tokens = chunks = 0
        try:
            for chunk in stub.GenerateStream(_request(f"stream {_long(index)}", max_tokens), metadata=METADATA,
                                             timeout=600):
                chunks += 1
                tokens += len(chunk.token_ids)
        except grpc.RpcError as error:
            code, details, _ = _error(error)
            return f"{code}: after {chunks} chunks: {details}", tokens
        return "OK", tokens

    return _pool(total, concurrency, one)


def budget(stub: Any, total: int, concurrency: int, max_tokens: int) -> dict[str, Any]:
    def one(index: int) -> tuple[str, int]:
        try:
            response = stub.Generate(_request(f"unary {_long(index)}", max_tokens), metadata=METADATA, timeout=600)
        except grpc.RpcError as error:
            code, details, _ = _error(error)
            done = re.search(r"after (\d+) of", details)  # generated, then thrown away
            return f"{code}: {details}", int(done.group(1)) if done else 0
        return "OK", response.completion_tokens

    return _pool(total, concurrency, one)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("scenario", choices=["priority", "streams", "budget"])
    parser.add_argument("--layout", default="collapsed", choices=["collapsed", "layered"])
    parser.add_argument("--burn", type=int, default=0, help="busy-looping processes alongside")
    parser.add_argument("--queued", type=int, default=200)
    parser.add_argument("--flood", type=int, default=0)
    parser.add_argument("--settle-s", type=float, default=2.0)
    parser.add_argument("--total", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=None)
    args = parser.parse_args()
    with served(args.layout, {}) as (stub, target), burning(args.burn) as load_average:
        idle = _footprint(target)
        started, cpu_before = time.perf_counter(), target.tree_cpu_s()
        if args.scenario == "priority":
            result = priority(stub, target, args.queued, args.max_tokens or 256, args.flood, args.settle_s)
        elif args.scenario == "streams":
            result = streams(stub, args.total or 1000, args.concurrency or 128, args.max_tokens or 128)
        else:
            result = budget(stub, args.total or 400, args.concurrency or 64, args.max_tokens or 256)
        server_cpu_s = target.tree_cpu_s() - cpu_before
        result.update(scenario=args.scenario, layout=args.layout, burners=args.burn,
                      peak_load_average=load_average(), elapsed_s=round(time.perf_counter() - started, 1),
                      server_cpu_s=round(server_cpu_s, 1), server_idle=idle)
        if result.get("tokens"):
            result["server_cpu_ms_per_token"] = round(1000.0 * server_cpu_s / result["tokens"], 3)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
