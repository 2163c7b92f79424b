"""The pre-generated table's costs and the output policy's, measured on this machine:

    python -m bench.answer_table [--entries 100000] [--out FILE]

* lookup µs at `--entries` entries (a greedy request's key, the probe, the answer parsed),
  hits and misses;
* start: open, map and checksum the file (what a process does at start, and on a swap);
* memory: two replica processes mapping the same table, their PSS and RSS from
  /proc/PID/smaps_rollup, against a pair without it — the table's pages are counted once
  across both (each replica's PSS carries half), where RSS counts them in each;
* the output policy: µs per stream-chunk check (the TTFT it adds: the first chunk waits for
  one check) and per whole-answer check, with a few phrases and patterns.

Prints one JSON object. Bounded: one table, a fixed number of lookups and checks.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from services.cache.pregenerated import table_key, write_table
from services.cache.pregenerated_answers import PregeneratedAnswers
from services.inference.output_policy import OutputPolicy, OutputPolicyConfig
from spine.tools.tree_sampler import memory_rollup
from wire.v1 import generation_pb2

DIGEST = b"\x42" * 32
MODEL = "tiny-lm"


def _answer(i: int) -> generation_pb2.GenerateResponse:
    tokens = [(i * 31 + j) % 256 for j in range(32)]
    return generation_pb2.GenerateResponse(text=f"pre-generated answer number {i}, " + "x" * 40, token_ids=tokens,
                                           model=MODEL, finish_reason="length", prompt_tokens=20,
                                           completion_tokens=32, system_digest="0123456789abcdef")


def _request(i: int) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(model=MODEL, prompt=f"common prompt {i}", max_tokens=32)


_REPLICA = """
import sys, time
from services.cache.pregenerated_answers import PregeneratedAnswers
table = PregeneratedAnswers(sys.argv[1], {"tiny-lm": bytes.fromhex(sys.argv[2])}) if sys.argv[1] != "-" else None
print("ready", flush=True)
sys.stdin.readline()
"""


def _replicas(path: str, count: int) -> list[dict[str, int]]:
    """`count` processes mapping `path` ('-': none) at once; each one's smaps_rollup."""
    processes = [subprocess.Popen([sys.executable, "-c", _REPLICA, path, DIGEST.hex()], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True) for _ in range(count)]
    try:
        for process in processes:
            assert process.stdout is not None and process.stdout.readline().strip() == "ready"
        return [memory_rollup(process.pid) for process in processes]
    finally:
        for process in processes:
            assert process.stdin is not None
            process.stdin.close()
            process.wait(timeout=30)


def measure_table(entries: int, directory: Path) -> dict[str, Any]:
    path = directory / "table.bin"
    started = time.perf_counter()
    write_table(path, MODEL, DIGEST, ((table_key(MODEL, "", f"common prompt {i}", 32), _answer(i))
                                      for i in range(entries)))
    written_s = time.perf_counter() - started
    starts = []
    for _ in range(5):
        started = time.perf_counter()
        answers = PregeneratedAnswers(path, {MODEL: DIGEST})
        starts.append(time.perf_counter() - started)
    rng = random.Random(7)
    hits = [_request(rng.randrange(entries)) for _ in range(20000)]
    misses = [_request(entries + i) for i in range(20000)]
    out: dict[str, Any] = {"entries": entries, "file_mb": round(path.stat().st_size / 2**20, 2),
                           "write_s": round(written_s, 3),
                           "start_ms_median": round(statistics.median(starts) * 1000, 2)}
    for name, requests in (("hit", hits), ("miss", misses)):
        started = time.perf_counter()
        for request in requests:
            answers.lookup(request)
        out[f"lookup_{name}_us"] = round((time.perf_counter() - started) / len(requests) * 1e6, 2)
    assert answers.lookup(hits[0]) is not None and answers.lookup(misses[0]) is None
    assert answers.table is not None
    answers.table.close()  # only the replicas map it now: their PSS shares the pages two ways
    without = _replicas("-", 2)[0]  # a pair too: the interpreter's own pages shared the same two ways
    pair = _replicas(str(path), 2)
    out["memory_kb"] = {"replica_without_table": without, "replicas_with_table": pair,
                        "table_pss_per_replica_kb": [r["pss_kb"] - without["pss_kb"] for r in pair],
                        "table_rss_per_replica_kb": [r["rss_kb"] - without["rss_kb"] for r in pair]}
    return out


def measure_policy() -> dict[str, Any]:
    policy = OutputPolicy(OutputPolicyConfig.model_validate({"rules": [
        {"name": "phrases", "phrases": ["internal use only", "do not distribute", "confidential"]},
        {"name": "keys", "patterns": [r"\bAKIA[0-9A-Z]{16}\b", r"-----BEGIN [A-Z ]*PRIVATE KEY-----"]},
    ]}))
    chunk = "a few words of an answer "
    rounds = 20000
    stream = policy.stream("dev", MODEL)
    assert stream is not None
    started = time.perf_counter()
    for _ in range(rounds):
        stream.check(chunk, (1, 2, 3))
    per_chunk = (time.perf_counter() - started) / rounds
    first = []
    for _ in range(2000):
        started = time.perf_counter()
        fresh = policy.stream("dev", MODEL)
        assert fresh is not None
        fresh.check(chunk, (1, 2, 3))
        first.append(time.perf_counter() - started)
    whole = chunk * 40
    started = time.perf_counter()
    for _ in range(2000):
        policy.check("dev", MODEL, whole, ())
    return {"stream_chunk_check_us": round(per_chunk * 1e6, 2),
            "added_ttft_us_median": round(statistics.median(first) * 1e6, 2),
            "whole_answer_check_us": round((time.perf_counter() - started) / 2000 * 1e6, 2),
            "whole_answer_chars": len(whole)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="spine-answer-table-") as directory:
        results = {"table": measure_table(args.entries, Path(directory)), "policy": measure_policy(),
                   "cpus": os.cpu_count()}
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
