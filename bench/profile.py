"""`make profile`: where the collapsed spine spends its CPU under load, as a flame graph.

    python -m bench.profile [--concurrency 64] [--seconds 15] [--layout collapsed] [--against bare] [--out bench/]

Starts the layout in its own process (the bench's config: rate limits out of the way),
drives closed-loop load from this process (its own GIL, as in `make bench`), and samples
the server with py-spy, native frames left out: a flame graph of every thread
(`profile.svg`), and the thread holding the interpreter lock (`--gil`) for the tables: the
server's CPU per request over the same window by thread (`bench.targets.THREAD_GROUPS`,
read from the kernel), and that CPU split by part of the code (the model, the middlewares'
services, the pipeline, gRPC, the rest) and by function. With `--against bare` (what
`make profile` runs) it starts bare too, loads the two in turns of a second, samples both,
and prints what the layout adds per request, part by part: the question a change to the
request path has to answer.

Why each thread's CPU is split by its own samples instead of counting samples: py-spy
samples without stopping the process (`--nonblocking`; stopping it cut the spine's
throughput to a quarter), and then it can only guess whether a thread is running (py-spy
issue #480). On the one CPU a model-serving process is kept on, the guess overstates the
decode loop: counting samples gave the middlewares, the pipeline and gRPC a fraction of
the share the kernel's own per-thread CPU gave the handler threads (which run them), and at
high concurrency left the handlers almost unsampled. The lock's holder is known for sure
(many times more handler samples over the same window), the
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bench.device_regime import DEVICE_OVERLAY, SIM_OPTIONS
from bench.load import Endpoint, prompts, requests_for, run_batch
from bench.settings import RATE_LIMIT_OFF
from bench.targets import (
    REPO_ROOT,
    SPINE_LAYOUT,
    keep_load_generator_off,
    launch,
    server_cpu,
    thread_cpu_by_group,
    thread_group,
)
from runtime.config.file import merge
from runtime.config.served_model import model_id_for, model_overrides

# Leaf frames that are a thread waiting, not working.
IDLE = ("wait", "_wait", "acquire", "select", "poll", "epoll", "_serve", "_status", "get", "sleep", "recv",
        "_worker", "readline", "accept")
# A leaf whose current line is one of these is a thread blocked on it, whatever the function:
# without native frames py-spy shows a C call's caller as the leaf (`slot.wake.acquire()`
# inside `MicroBatcher.submit`), and on the one CPU the servers share a thread that has
# been woken but not yet run still counts as active. Those samples were the top "self time"
# entry before they were read as what they are.
BLOCKING_LINE = re.compile(r"\.(acquire|wait|wait_for|join|result)\(|\bsleep\(|^with\s+[\w.]*lock\b")
# Load goes to each layout in turns this long (the last turn's requests still finish):
# the host's speed drifts over minutes, and a layout profiled after another read slower for it.
ROUND_S = 1.0
ROUND_REQUESTS = 2000  # more than a turn sends at any concurrency here
# The model service's own code (its servicer and scheduler too: bare runs them as well) is
# "model"; every other service is a middleware's.
PARTS = (("model", ("services/inference/model/", "services/inference")), ("pipeline", ("services/pipeline/", "monolith/")),
         ("middleware services", ("services/",)), ("runtime", ("runtime/",)),
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
    parser.add_argument("--model", metavar="DIR", help="profile this model directory instead of the embedded "
                        "model; `sim`: the device regime's simulated model (`make profile` on the device regime: "
                        "python -m bench.profile --model sim --against bare)")
    parser.add_argument("--against", choices=["bare"], help="also profile bare the same way, loaded in turns with "
                        "the layout, and print what the layout adds to it by part of the code (files profile-bare.*)")
    return parser.parse_args(argv)


@dataclass
class Profiled:
    """One layout's profile: its report and the CPU per request by part of the code."""

    report: str
    parts_us: dict[str, float]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        print("py-spy is not installed: `make install` (it is a dev dependency)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)  # py-spy writes into it, and fails if it is missing
    layouts = [args.layout] + ([args.against] if args.against and args.against != args.layout else [])
    profiled = profile(layouts, args, py_spy)
    if profiled is None:
        return 1
    report = profiled[args.layout].report
    if len(layouts) == 2:
        table = difference_table(args.layout, profiled[args.layout].parts_us, args.against,
                                 profiled[args.against].parts_us)
        print(table)
        report += "\n" + table
    (args.out / "profile.txt").write_text(report)
    return 0


def config_for(model: str | None) -> dict[str, Any]:
    """The servers' config: the bench's, serving `model` (`sim`: as the device regime serves it)."""
    if not model:
        return RATE_LIMIT_OFF
    if model == "sim":
        return merge(merge(RATE_LIMIT_OFF, model_overrides(model, sim_options=SIM_OPTIONS)), DEVICE_OVERLAY)
    return merge(RATE_LIMIT_OFF, model_overrides(model))


def profile(layouts: list[str], args: argparse.Namespace, py_spy: str) -> dict[str, Profiled] | None:
    """Start every layout, load them in turns of `ROUND_S` (so the host's drift over the
    minutes reaches each alike) while py-spy samples them all; write each one's
    .raw/.svg/.txt under `args.out` (`profile.*` for the first, `profile-<layout>.*` after)."""
    run_dir = Path(tempfile.mkdtemp(prefix="spine-profile-"))
    config = run_dir / "config.yaml"
    config.write_text(yaml.safe_dump(config_for(args.model)))
    targets = {layout: launch(layout, run_dir, config) for layout in layouts}
    samplers: list[subprocess.Popen[bytes]] = []
    try:
        endpoints = {layout: Endpoint(target.wait_ready(120), gateway=layout != "bare", token="spine-dev-key-0000")
                     for layout, target in targets.items()}
        keep_load_generator_off(server_cpu())  # before py-spy starts: it runs beside the load generator
        requests = requests_for(prompts("profile", 200_000), args.max_tokens,
                                model_id_for(args.model) if args.model else "tiny-lm")
        for endpoint in endpoints.values():
            run_batch(endpoint, requests[:200], concurrency=args.concurrency, time_limit_s=10)  # warm up
        names = {layout: "profile" if i == 0 else f"profile-{layout}" for i, layout in enumerate(layouts)}
        duration = str(int(args.seconds * len(layouts) + 5))
        for layout, target in targets.items():
            common = ["record", "--pid", str(target.pid), "--duration", duration, "--rate", str(args.rate),
                      "--subprocesses", "--nonblocking"]
            samplers.append(subprocess.Popen(
                [py_spy, *common, "--format", "flamegraph", "--output", str(args.out / f"{names[layout]}.svg")],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
            samplers.append(subprocess.Popen(
                [py_spy, *common, "--gil", "--threads", "--format", "raw", "--output", str(args.out / f"{names[layout]}.raw")],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        time.sleep(1.0)  # the samplers attached
        before = {layout: target.tree_thread_cpu_s() for layout, target in targets.items()}
        calls = dict.fromkeys(layouts, 0)
        wall = dict.fromkeys(layouts, 0.0)
        sent = 200
        while min(wall.values()) < args.seconds:
            for layout in layouts:
                if sent + ROUND_REQUESTS > len(requests):
                    sent = 200  # a long profile sends the prompts again
                batch = run_batch(endpoints[layout], requests[sent:sent + ROUND_REQUESTS], concurrency=args.concurrency,
                                  time_limit_s=ROUND_S)
                if not batch.calls:
                    print(f"{layout} answered nothing in a turn of {ROUND_S:g} s: see its log", file=sys.stderr)
                    return None
                sent += len(batch.calls)
                calls[layout] += len(batch.calls)
                wall[layout] += batch.wall_s
        by_thread = {layout: thread_cpu_by_group(before[layout], target.tree_thread_cpu_s())
                     for layout, target in targets.items()}
        for sampler in samplers:
            _, err = sampler.communicate(timeout=args.seconds * len(layouts) + 90)
            if sampler.returncode != 0:
                print(f"py-spy failed: {err.decode(errors='replace')[-400:]}", file=sys.stderr)
                return None
        out: dict[str, Profiled] = {}
        for layout in layouts:
            raw, rps = args.out / f"{names[layout]}.raw", calls[layout] / wall[layout] if wall[layout] else 0.0
            layout_args = argparse.Namespace(**{**vars(args), "layout": layout, "seconds": wall[layout]})
            samples = _read_samples(raw)
            report = (_summary(samples, rps, layout_args, by_thread[layout], calls[layout])
                      + thread_table(by_thread[layout], calls[layout]))
            (args.out / f"{names[layout]}.txt").write_text(report)
            print(report)
            print(f"flame graph: {args.out / (names[layout] + '.svg')}\n")
            _, _, by_part, _ = samples
            parts_us = _weighted(by_part, by_thread[layout], calls[layout]) if calls[layout] else {}
            out[layout] = Profiled(report, parts_us)
        for endpoint in endpoints.values():
            endpoint.close()
        return out
    finally:
        for sampler in samplers:
            if sampler.poll() is None:
                sampler.kill()
                sampler.wait()
        for target in targets.values():
            target.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


def difference_table(layout: str, parts: dict[str, float], baseline: str, base_parts: dict[str, float]) -> str:
    """What `layout` spends per request beyond `baseline`, by part of the code (µs)."""
    names = sorted(set(parts) | set(base_parts), key=lambda part: -(parts.get(part, 0.0) - base_parts.get(part, 0.0)))
    lines = [f"CPU per request by part of the code, {layout} against {baseline} (µs; loaded in turns):",
             f"  {'part':26s} {baseline:>8s} {layout:>10s} {'difference':>11s}"]
    lines += [f"  {part:26s} {base_parts.get(part, 0.0):8.0f} {parts.get(part, 0.0):10.0f} "
              f"{parts.get(part, 0.0) - base_parts.get(part, 0.0):+11.0f}" for part in names]
    total, base_total = sum(parts.values()), sum(base_parts.values())
    lines.append(f"  {'total':26s} {base_total:8.0f} {total:10.0f} {total - base_total:+11.0f}")
    return "\n".join(lines) + "\n"


def summarize(raw: Path, rps: float, args: argparse.Namespace, cpu_by_group: dict[str, float] | None = None,
              requests: int = 0) -> str:
    """CPU per request by part of the code and the 20 functions with the most self CPU: each
    thread group's CPU (`cpu_by_group`, seconds over the window of `requests`) split by the
    share of its busy samples. Without them (or without thread names in the samples), the
    shares of all busy samples."""
    return _summary(_read_samples(raw), rps, args, cpu_by_group, requests)


def _summary(samples: Samples, rps: float, args: argparse.Namespace, cpu_by_group: dict[str, float] | None,
             requests: int) -> str:
    busy, total, by_group, leaves = samples
    weighted = bool(cpu_by_group and requests and set(by_group) - {""})
    head = (f"{args.layout} at c={args.concurrency}: {rps:.1f} rps over {args.seconds:.3g} s of load; "
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


Counts = dict[str, collections.Counter[str]]
Samples = tuple[int, int, Counts, Counts]  # busy, all, and the busy ones by group: per part, per leaf


def _read_samples(raw: Path) -> Samples:
    """Busy and all samples, and the busy ones by thread group: per part of the code and
    per leaf function."""
    by_group: Counts = collections.defaultdict(collections.Counter)
    leaves: Counts = collections.defaultdict(collections.Counter)
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
    return busy, total, by_group, leaves


def _sampled_thread_group(frames: list[str]) -> str:
    """The thread group of a sample whose stack names its thread, `thread (ID): NAME` (py-spy
    `--threads`; after the process's own frame with `--subprocesses`), "" when it names none."""
    named = next((frame for frame in frames[:2] if frame.startswith("thread (")), None)
    return "" if named is None else thread_group(named.partition("): ")[2])


def _weighted(counts: Counts, cpu_by_group: dict[str, float],
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
