"""`make profile`: where the collapsed spine spends its CPU under load, as a flame graph.

    python -m bench.profile [--concurrency 64] [--seconds 15] [--layout collapsed] [--out bench/]

Starts the layout in its own process (the bench's config: rate limits out of the way),
drives closed-loop load from this process (its own GIL, as in `make bench`), and samples
the server with py-spy, native frames left out: a flame graph of every thread
(`profile.svg`), and the thread holding the interpreter lock (`--gil`) for the tables: the
server's CPU per request over the same window by thread (`bench.targets.THREAD_GROUPS`,
read from the kernel), and that CPU split by part of the code (the model, the middlewares'
services, the pipeline, gRPC, the rest) and by function.

Why each thread's CPU is split by its own samples instead of counting samples: py-spy
samples without stopping the process (`--nonblocking`; stopping it cut the spine's
throughput to a quarter), and then it can only guess whether a thread is running (py-spy
issue #480). On the one CPU a model-serving process is kept on, the guess overstates the
decode loop: one run at c=16 read the model at 89% of the busy samples and the
middlewares, the pipeline and gRPC at 7%, while the kernel put the handler threads (which
run the middlewares) at 18% of the process's CPU; at c=64 the handlers got 9 samples in
15 s. The lock's holder is known for sure (221 handler samples in the same run), the
kernel's CPU per thread is exact, and the samples say which code a thread ran. Samples on
a line that waits (a lock's acquire, a condition's wait: py-spy shows a C call's caller as
the leaf) are idle.
"""

from __future__ import annotations

import argparse
import collections
import linecache
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench.load import Endpoint, prompts, requests_for, run_batch
from bench.run import RATE_LIMIT_OFF
from bench.targets import REPO_ROOT, SPINE_LAYOUT, launch, thread_cpu_by_group, thread_group

# Leaf frames that are a thread waiting, not working.
IDLE = ("wait", "_wait", "acquire", "select", "poll", "epoll", "_serve", "_status", "get", "sleep", "recv",
        "_worker", "readline", "accept")
# A leaf whose current line is one of these is a thread blocked on it, whatever the function:
# without native frames py-spy shows a C call's caller as the leaf (`slot.wake.acquire()`
# inside `MicroBatcher.submit`), and on the one CPU the servers share a thread that has
# been woken but not yet run still counts as active. Those samples were the top "self time"
# entry (10% of busy samples) before they were read as what they are.
BLOCKING_LINE = re.compile(r"\.(acquire|wait|wait_for|join|result)\(|\bsleep\(|^with\s+[\w.]*lock\b")
# The model service's own code (its servicer and scheduler too: bare runs them as well) is
# "model"; every other service is a middleware's.
PARTS = (("model", ("services/model/", "services/inference")), ("pipeline", ("services/pipeline/", "monolith/")),
         ("middleware services", ("services/",)), ("runtime", ("spine/runtime/",)),
         ("grpc", ("grpc/",)), ("torch", ("torch/",)), ("threading", ("threading.py", "queue.py")))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.splitlines()[0])
    parser.add_argument("--layout", default="collapsed", choices=["bare", *sorted(SPINE_LAYOUT)],
                        help="bare: the model service alone, the baseline the others are compared with")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second (fewer: it keeps up "
                        "with many threads)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        print("py-spy is not installed: `make install` (it is a dev dependency)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)  # py-spy writes into it, and fails if it is missing
    run_dir = Path(tempfile.mkdtemp(prefix="spine-profile-"))
    config = run_dir / "config.yaml"
    config.write_text(yaml.safe_dump(RATE_LIMIT_OFF))
    target = launch(args.layout, run_dir, config)
    try:
        address = target.wait_ready(120)
        endpoint = Endpoint(address, gateway=args.layout != "bare", token="spine-dev-key-0000")
        requests = requests_for(prompts("profile", 200_000), args.max_tokens)
        run_batch(endpoint, requests[:200], concurrency=args.concurrency, time_limit_s=10)  # warm up
        raw = args.out / "profile.raw"  # kept beside the flame graph: grep it for any function
        svg = args.out / "profile.svg"
        common = ["record", "--pid", str(target.pid), "--duration", str(int(args.seconds)), "--rate", str(args.rate),
                  "--subprocesses", "--nonblocking"]
        flame = subprocess.Popen([py_spy, *common, "--format", "flamegraph", "--output", str(svg)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        collapsed = subprocess.Popen([py_spy, *common, "--gil", "--threads", "--format", "raw", "--output", str(raw)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.0)  # both samplers attached
        threads_before = target.tree_thread_cpu_s()
        batch = run_batch(endpoint, requests[200:], concurrency=args.concurrency, time_limit_s=args.seconds)
        by_thread = thread_cpu_by_group(threads_before, target.tree_thread_cpu_s())
        for sampler in (flame, collapsed):
            _, err = sampler.communicate(timeout=args.seconds + 60)
            if sampler.returncode != 0:
                print(f"py-spy failed: {err.decode(errors='replace')[-400:]}", file=sys.stderr)
                return 1
        rps = len(batch.calls) / batch.wall_s if batch.wall_s else 0.0
        report = summarize(raw, rps, args, by_thread, len(batch.calls)) + thread_table(by_thread, len(batch.calls))
        (args.out / "profile.txt").write_text(report)
        print(report)
        print(f"flame graph: {svg}")
        endpoint.close()
    finally:
        target.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
    return 0


def summarize(raw: Path, rps: float, args: argparse.Namespace, cpu_by_group: dict[str, float] | None = None,
              requests: int = 0) -> str:
    """CPU per request by part of the code and the 20 functions with the most self CPU: each
    thread group's CPU (`cpu_by_group`, seconds over the window of `requests`) split by the
    share of its busy samples. Without them (or without thread names in the samples), the
    shares of all busy samples."""
    by_group: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    leaves: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    busy = total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        leaf = frames[-1]
        name = leaf.split(" (")[0].rsplit(".", 1)[-1]
        if " (" not in leaf or any(name == idle or name.endswith(idle) for idle in IDLE) or blocked_at(leaf):
            continue  # a thread in native code with no Python frame, or waiting
        busy += n
        group = _sampled_thread_group(frames)
        where = leaf.split(" (")[-1]
        by_group[group][next((part for part, paths in PARTS if any(p in where for p in paths)), "other")] += n
        leaves[group][leaf] += n
    weighted = bool(cpu_by_group and requests and set(by_group) - {""})
    head = (f"{args.layout} at c={args.concurrency}: {rps:.1f} rps over {args.seconds:g} s; "
            f"{busy} of {total} samples busy")
    if not weighted:
        parts = sum(by_group.values(), collections.Counter())
        self_time = sum(leaves.values(), collections.Counter())
        lines = [head, "", "share of busy samples by part of the code:"]
        lines += [f"  {part:22s} {100 * n / max(busy, 1):5.1f}%" for part, n in parts.most_common()]
        lines += ["", "top 20 functions by self time (busy samples):"]
        lines += [f"  {100 * n / max(busy, 1):5.1f}%  {leaf}" for leaf, n in self_time.most_common(20)]
        return "\n".join(lines) + "\n"
    assert cpu_by_group is not None
    parts_us = _weighted(by_group, cpu_by_group, requests)
    leaves_us = _weighted(leaves, cpu_by_group, requests)
    unsampled = {group: seconds for group, seconds in cpu_by_group.items() if seconds > 0 and not by_group.get(group)}
    lines = [head, "", "CPU per request by part of the code (each thread group's CPU split by its busy samples):"]
    lines += [f"  {part:26s} {us:8.0f} µs" for part, us in sorted(parts_us.items(), key=lambda kv: -kv[1])]
    lines += [f"  {'(unsampled: ' + group + ')':26s} {1e6 * seconds / requests:8.0f} µs"
              for group, seconds in unsampled.items()]
    lines += ["", "the same by thread group (a group's split is as fine as its samples are many):"]
    for group, parts in sorted(by_group.items(), key=lambda kv: -cpu_by_group.get(kv[0], 0.0)):
        split = _weighted({group: parts}, cpu_by_group, requests)
        cells = ", ".join(f"{part} {us:.0f}" for part, us in sorted(split.items(), key=lambda kv: -kv[1]) if us >= 0.5)
        lines.append(f"  {group or '(unnamed)':12s} {1e6 * cpu_by_group.get(group, 0.0) / requests:6.0f} µs "
                     f"({sum(parts.values())} samples): {cells}")
    lines += ["", "top 20 functions by self CPU per request (µs, weighted the same way):"]
    lines += [f"  {us:7.1f}  {leaf}" for leaf, us in sorted(leaves_us.items(), key=lambda kv: -kv[1])[:20]]
    return "\n".join(lines) + "\n"


def _sampled_thread_group(frames: list[str]) -> str:
    """The thread group of a sample whose stack names its thread, `thread (ID): NAME` (py-spy
    `--threads`; after the process's own frame with `--subprocesses`), "" when it names none."""
    named = next((frame for frame in frames[:2] if frame.startswith("thread (")), None)
    return "" if named is None else thread_group(named.partition("): ")[2])


def _weighted(counts: dict[str, collections.Counter[str]], cpu_by_group: dict[str, float],
              requests: int) -> dict[str, float]:
    """µs per request per key: each group's CPU shared out by its keys' sample counts."""
    out: dict[str, float] = collections.defaultdict(float)
    for group, keys in counts.items():
        samples = sum(keys.values())
        seconds = cpu_by_group.get(group, 0.0)
        for key, n in keys.items():
            out[key] += 1e6 * seconds / requests * n / samples
    return dict(out)


def blocked_at(leaf: str) -> bool:
    """Whether a leaf frame, `function (path:line)`, stands on a line that blocks (a lock's
    acquire, a wait, a join, a sleep); its path is relative to the repository or absolute."""
    where = leaf.rpartition(" (")[2].rstrip(")")
    path, _, line = where.rpartition(":")
    if not path or not line.isdigit():
        return False
    source = Path(path) if Path(path).is_absolute() else REPO_ROOT / path
    return bool(BLOCKING_LINE.search(linecache.getline(str(source), int(line)).strip()))


def thread_table(by_thread: dict[str, float], requests: int) -> str:
    """The server's CPU per request by thread group over the sampled window (the samples say
    which code; this says which thread, and it counts the time py-spy calls idle too)."""
    if not requests:
        return ""
    lines = ["", f"server CPU per request by thread over the same window ({requests} requests):"]
    lines += [f"  {group:12s} {1e6 * seconds / requests:8.0f} µs" for group, seconds in by_thread.items()]
    lines.append(f"  {'total':12s} {1e6 * sum(by_thread.values()) / requests:8.0f} µs")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
