"""The servers under test, each in its own process(es), started and stopped by PID.

Why subprocesses: the load generator runs in the bench process; a server sharing its
GIL would be slowed by the very load it is measuring, and unequally across layouts.

    bare       python -m runtime.process inference ...   (the model service, no middleware)
    collapsed  python -m spine --config F up --layout collapsed   (the batched spine)
    collapsed-unbatched  the same with the batcher off end to end: `batching.enabled: false`
               (one call per middleware per request) and `inference.max_batch: 1` (one
               sequence per model step). The issue's micro-batcher batches the model step
               too ("one batched model step for the misses"), so "batcher off" means both.
    collapsed-middleware-unbatched  only the middleware batcher off; the model still
               batches decode steps across requests. What batching the middleware alone is
               worth, and the bound on it: at best this equals bare.
    layered    python -m spine --config F up --layout layered  (+ one child per component)
    layered-batched  the same with `batching.remote: true`: the layered gateway batches too,
               one batch rpc per hop per micro-batch instead of one call per request per hop
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
from prometheus_client.parser import text_string_to_metric_families

from runtime.observability.serving_metrics_export import ADDRESS_FILE as INFERENCE_METRICS_ADDRESS
from runtime.processes.launch import READY, Launched, LaunchFailed, serving_on, spine_up_argv
from runtime.processes.launch import launch as launch_process
from services.inference.cpu_placement import ENV as CPU_PLACEMENT_ENV
from spine.tools.tree_sampler import tree_cpu_seconds, tree_rss_bytes, tree_thread_cpu_seconds

REPO_ROOT = Path(__file__).resolve().parents[1]
# Which `spine up --layout` each bench layout but bare runs (bare is the model service alone).
SPINE_LAYOUT: dict[str, str] = {"collapsed": "collapsed", "collapsed-unbatched": "collapsed",
                                "collapsed-middleware-unbatched": "collapsed", "layered": "layered",
                                "layered-batched": "layered"}
LAYOUTS: tuple[str, ...] = ("bare", *SPINE_LAYOUT)
# `--quick` (the smoke test) keeps to these, inside its time limit.
QUICK_LAYOUTS: tuple[str, ...] = ("bare", "collapsed", "layered")
MIDDLEWARE_UNBATCHED_OVERLAY: dict[str, object] = {"batching": {"enabled": False}}
UNBATCHED_OVERLAY: dict[str, object] = {**MIDDLEWARE_UNBATCHED_OVERLAY, "inference": {"max_batch": 1}}
REMOTE_BATCHED_OVERLAY: dict[str, object] = {"batching": {"remote": True}}


TargetFailed = LaunchFailed  # a server that did not come up; the message ends with its log's tail

_LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback only: no proxy from the env


@dataclass
class Target:
    """One running layout (`runtime.processes.launch`): its process tree, the address to call, and how to reach it."""

    layout: str
    launched: Launched
    address: str = ""
    http_address: str | None = None  # its HTTP API (spine layouts), from the ready line
    run_dir: Path | None = None  # where its processes write their metrics addresses

    @property
    def pid(self) -> int:
        return self.launched.pid

    @property
    def process(self) -> subprocess.Popen[bytes]:
        return self.launched.process

    @property
    def log_path(self) -> Path:
        return self.launched.log_path

    @property
    def is_gateway(self) -> bool:
        """Whether clients speak the Gateway API (with a key) rather than bare Inference."""
        return self.layout != "bare"

    def wait_ready(self, timeout_s: float) -> str:
        """Block until the server prints its ready line; return the address to dial."""
        ready = self.launched.wait_ready(timeout_s, serving_on if self.layout == "bare" else READY)
        self.address = str(ready["address"])
        self.http_address = ready.get("http_address")
        return self.address

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def tree(self) -> list[psutil.Process]:
        """The root process and all its descendants that are alive now (remembered for stop)."""
        return self.launched.tree()

    def tree_cpu_s(self) -> float:
        """User + system CPU seconds of the process tree so far (`tree_cpu_seconds`)."""
        return tree_cpu_seconds(self.pid)

    def model_steps(self) -> tuple[float, float]:
        """(sequences, steps) the model processes of this layout have stepped so far: the sum
        and count of `spine_batch_size` on every /metrics its processes serve (the address
        files under its run directory). Subtract two readings around a round: steps per
        request and sequences per step say whether a layout kept the model's batches full —
        a layout that takes longer to hand requests over, with as many clients as KV slots,
        leaves slots empty and pays each step's fixed cost over fewer requests."""
        sequences = steps = 0.0
        found = sorted(self.run_dir.rglob("*.addr")) if self.run_dir else []
        # A model process of its own serves its figures on its own endpoint, and the metrics
        # endpoint forwards them too: read them once, at the model's.
        models = [path for path in found if path.name == INFERENCE_METRICS_ADDRESS]
        for path in models or found:
            try:
                address = path.read_text().strip()
                with _LOCAL.open(f"http://{address}/metrics", timeout=2.0) as answer:
                    text = answer.read().decode()
            except (OSError, ValueError):
                continue  # not up (yet), or gone: the reading says nothing for it
            for family in text_string_to_metric_families(text):
                if family.name == "spine_batch_size":
                    for sample in family.samples:  # every model's
                        if sample.name.endswith("_sum"):
                            sequences += sample.value
                        elif sample.name.endswith("_count"):
                            steps += sample.value
        return sequences, steps

    def tree_thread_cpu_s(self) -> dict[tuple[int, int], tuple[str, float]]:
        """Each thread of the process tree alive now: (pid, thread id) -> (its group, CPU
        seconds so far). Subtract two readings around a round (`thread_cpu_by_group`)."""
        return {key: (thread_group(name), seconds)
                for key, (name, seconds) in tree_thread_cpu_seconds(self.pid).items()}

    def tree_rss_bytes(self) -> int:
        """Resident memory summed over the process tree (shared pages count once per process)."""
        return tree_rss_bytes(self.pid)  # the module's function, not this method

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the root (it stops its own children), then SIGKILL whatever of ours is left."""
        self.launched.stop(grace_s)

    def alive_pids(self) -> list[int]:
        """Processes of this target still running (should be none after stop)."""
        return self.launched.alive_pids()


def server_cpu() -> str | None:
    """The CPU the model process of bare and of every collapsed layout runs on (`SPINE_CPU`):
    the same one for all, so no ratio depends on which CPU a layout drew — the last this
    process may use; the load generator keeps the others (`keep_load_generator_off`). None
    on a single CPU."""
    allowed = sorted(os.sched_getaffinity(0))
    return str(allowed[-1]) if len(allowed) >= 2 else None


def keep_load_generator_off(cpu: str | None) -> None:
    """Move this process (the load generator) off the servers' CPU. Call after the servers
    have started: a child inherits its parent's CPUs, and theirs must include `cpu`."""
    if cpu is not None and CPU_PLACEMENT_ENV not in os.environ:
        os.sched_setaffinity(0, os.sched_getaffinity(0) - {int(cpu)})


def launch(layout: str, run_dir: Path, config_path: Path, *, code: Path = REPO_ROOT) -> Target:
    """Start one layout's server process, running the code of the checkout `code` (this one
    unless `bench.variants --tree` names another). Call from the main thread (see
    `runtime.processes.parent`)."""
    layout_dir = run_dir / layout
    layout_dir.mkdir(parents=True, exist_ok=True)
    # Every layout listens on a unix socket, so the ratios to bare measure the middleware
    # layer, not a transport difference (loopback TCP costs more per call than a socket file).
    if layout == "bare":
        argv = [sys.executable, "-m", "runtime.process", "inference", "--listen", f"unix:{layout_dir}/inf.sock",
                "--config", str(config_path), "--run-dir", str(layout_dir)]
    elif layout in SPINE_LAYOUT:
        argv = spine_up_argv(config_path, SPINE_LAYOUT[layout], listen=f"unix:{layout_dir}/gateway.sock",
                             http_listen=f"unix:{layout_dir}/http.sock", run_dir=layout_dir)
    else:
        raise ValueError(f"layout: expected one of {', '.join(LAYOUTS)}, got {layout!r}")
    env = dict(os.environ)
    cpu = server_cpu()
    if CPU_PLACEMENT_ENV in env or cpu is None:
        pass  # the caller's own placement, or nothing to choose
    elif SPINE_LAYOUT.get(layout) == "layered":
        # The layered stack keeps the OS's placement: its eight processes are spread over
        # every core (with its model process placed, its hops missed their budgets far more
        # often at the highest concurrency; the layered side is not to be slowed down).
        env[CPU_PLACEMENT_ENV] = "off"
    else:
        env[CPU_PLACEMENT_ENV] = cpu
    # The child dies with the bench (even by SIGKILL): `runtime.processes.launch`. `python -m` puts
    # its working directory first on sys.path: the checkout's packages are imported ahead of
    # the installed (editable) ones.
    launched = launch_process(layout, argv, log_path=run_dir / f"{layout}.log", cwd=code, env=env)
    return Target(layout, launched, run_dir=layout_dir)


# The server threads the bench tells apart, by the name they give the kernel
# (`services.common.thread_names`): what a layout spends per request beyond bare, and where. Each
# pattern matches the start of the name (the kernel keeps 15 bytes of it).
THREAD_GROUPS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("handlers", re.compile(r"grpc_\d+$")),  # the gRPC handler pool (not gRPC core's grpc_global_timer)
    ("model", re.compile(r"inference-sched")),  # the decode loop
    ("completions", re.compile(r"spine-completio")),  # the spine's deferred cache/log/metrics writes
    ("logs", re.compile(r"log-flusher")),  # the request log's file writer
    ("http-loop", re.compile(r"http-server")),  # the HTTP API's event loop: parsing, JSON, SSE writes
    ("http-handlers", re.compile(r"http_\d+$")),  # its handler pool, where the gateway runs for HTTP
)
OTHER_THREADS = "other"  # gRPC's own threads, the main thread, health and the rest


def thread_group(name: str) -> str:
    """The group a thread with kernel name `name` counts under."""
    return next((group for group, pattern in THREAD_GROUPS if pattern.match(name)), OTHER_THREADS)


def thread_cpu_by_group(before: dict[tuple[int, int], tuple[str, float]],
                        after: dict[tuple[int, int], tuple[str, float]]) -> dict[str, float]:
    """CPU seconds per group between two `tree_thread_cpu_s` readings (a thread started
    between them counts from zero; one that ended is lost)."""
    spent = dict.fromkeys([group for group, _ in THREAD_GROUPS] + [OTHER_THREADS], 0.0)
    for key, (group, seconds) in after.items():
        spent[group] += seconds - before.get(key, (group, 0.0))[1]
    return spent
