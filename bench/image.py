"""`python -m bench.image` (`make bench-image`): what running spine in its image costs, measured side by side.

For each layout, the same server started twice on this machine — as processes (`spine up`) and
as containers of the image `make image` built (spine.tools.containers: podman + runc, host
network, read-only root, non-root) — and per start:

- **start to ready**: from the command to the ready line (collapsed: `spine up`'s JSON line;
  layered as containers: every Deployment of deploy/k8s/layered, one container each, answering
  grpc.health.v1 SERVING on its probe port), the best of `--starts` starts;
- **RSS** after the same few requests: the server's processes (the container's, seen from the
  host: podman's `State.Pid` and its descendants), summed over every container of the layout.

Figures go into bench/image.json under `runtime` (beside `build`, which `make image` writes);
the printed table says the same. Ratios are container / process, from the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from runtime.processes.launch import launch
from runtime.server import free_ports, wait_serving
from spine.client.gateway_client import GatewayClient
from spine.tools.containers import Mount, Podman, owned_by_image_user, podman_missing, unique_prefix
from spine.tools.image import FIGURES, image_tag
from spine.tools.rehearsal.k8s_containers import containers_of, layered_host_ports, start_order
from spine.tools.rehearsal.kustomize import render
from wire.v1 import generation_pb2

ROOT = Path(__file__).resolve().parents[1]
KEY = "spine-dev-key-0000"


def tree_rss(pid: int) -> int:
    """RSS of `pid` and its descendants, in bytes."""
    try:
        root = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
    except psutil.Error:
        return 0


def first_answer(address: str, timeout_s: float = 180.0) -> None:
    """Poll until the layout answers a request (ready means answering, whatever a ready line says)."""
    deadline = time.monotonic() + timeout_s
    with GatewayClient(address, KEY) as client:
        while True:
            result = client.generate(generation_pb2.GenerateRequest(model="default", prompt="ready?", max_tokens=1),
                                     timeout=10)
            if result.ok:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{address} never answered: {result.code} {result.details}")
            time.sleep(0.05)


def exercise(address: str) -> None:
    with GatewayClient(address, KEY) as client:
        for i in range(8):
            result = client.generate(generation_pb2.GenerateRequest(model="default", prompt=f"bench image {i}",
                                                                    max_tokens=8), timeout=60)
            assert result.ok, result.details


def collapsed_process(work: Path) -> tuple[float, int]:
    grpc_port, http_port = free_ports(2)
    began = time.monotonic()
    child = launch("collapsed", [sys.executable, "-m", "spine", "up", "--layout", "collapsed", "--listen",
                                 f"127.0.0.1:{grpc_port}", "--http-listen", f"127.0.0.1:{http_port}", "--run-dir",
                                 str(work / "run")], log_path=work / "collapsed.log")
    try:
        child.wait_ready(120)
        first_answer(f"127.0.0.1:{grpc_port}")
        ready = time.monotonic() - began
        exercise(f"127.0.0.1:{grpc_port}")
        return ready, tree_rss(child.pid)
    finally:
        child.stop(15)


def collapsed_container(work: Path, image: str) -> tuple[float, int]:
    podman = Podman(image, unique_prefix("bench-image"))
    grpc_port, http_port = free_ports(2)
    owned_by_image_user(work / "run")
    argv = podman.run_argv("collapsed", ["up", "--layout", "collapsed", "--listen", f"127.0.0.1:{grpc_port}",
                                         "--http-listen", f"127.0.0.1:{http_port}", "--run-dir", "/var/run/spine"],
                           mounts=[Mount(work / "run", "/var/run/spine", read_only=False)])
    began = time.monotonic()
    child = launch("collapsed", argv, log_path=work / "collapsed-container.log", env=podman.env)
    try:
        child.wait_ready(120)
        first_answer(f"127.0.0.1:{grpc_port}")
        ready = time.monotonic() - began
        exercise(f"127.0.0.1:{grpc_port}")
        return ready, tree_rss(int(podman.inspect("collapsed", "{{.State.Pid}}")))
    finally:
        child.stop(15)
        podman.remove_all()


def layered_process(work: Path) -> tuple[float, int]:
    grpc_port, http_port = free_ports(2)
    began = time.monotonic()
    child = launch("layered", [sys.executable, "-m", "spine", "up", "--layout", "layered", "--listen",
                               f"127.0.0.1:{grpc_port}", "--http-listen", f"127.0.0.1:{http_port}", "--run-dir",
                               str(work / "run")], log_path=work / "layered.log")
    try:
        child.wait_ready(180)
        first_answer(f"127.0.0.1:{grpc_port}")
        ready = time.monotonic() - began
        exercise(f"127.0.0.1:{grpc_port}")
        return ready, tree_rss(child.pid)
    finally:
        child.stop(15)


def layered_containers(work: Path, image: str) -> tuple[float, int]:
    podman = Podman(image, unique_prefix("bench-layered"))
    specs = containers_of(render(ROOT / "deploy" / "k8s" / "layered"), work)
    began = time.monotonic()
    try:
        for wave in start_order(specs):
            for name in wave:
                spec = specs[name]
                argv = podman.run_argv(name, spec.command[1:], entrypoint=spec.command[:1], mounts=spec.mounts,
                                       env=spec.env, detach=True)
                subprocess.run(argv, check=True, capture_output=True, env={**podman.env, **spec.env}, timeout=120)
            for name in wave:
                if not wait_serving(specs[name].local(50080), timeout=180):
                    raise RuntimeError(f"{name} did not serve")
        first_answer(layered_host_ports(specs)["grpc"])
        ready = time.monotonic() - began
        exercise(layered_host_ports(specs)["grpc"])
        return ready, sum(tree_rss(int(podman.inspect(name, "{{.State.Pid}}"))) for name in specs)
    finally:
        podman.remove_all()


def measure(starts: int, image: str) -> dict[str, Any]:
    runs: dict[str, list[tuple[float, int]]] = {}
    cases: dict[str, Callable[[Path], tuple[float, int]]] = {
        "collapsed/process": collapsed_process,
        "collapsed/container": lambda w: collapsed_container(w, image),
        "layered/process": layered_process,
        "layered/container": lambda w: layered_containers(w, image)}
    for round_ in range(starts):  # interleaved, so a busy moment hits both sides
        for case, run in cases.items():
            with tempfile.TemporaryDirectory(prefix="spine-bench-image-") as tmp:
                runs.setdefault(case, []).append(run(Path(tmp)))
            print(f"  round {round_ + 1} {case}: ready {runs[case][-1][0]:.2f}s, rss {runs[case][-1][1] / 2**20:.0f} MiB",
                  flush=True)
    result: dict[str, Any] = {"starts": starts, "image": image}
    for layout in ("collapsed", "layered"):
        row: dict[str, Any] = {}
        for side in ("process", "container"):
            samples = runs[f"{layout}/{side}"]
            row[side] = {"start_to_ready_s": min(s for s, _ in samples),
                         "start_to_ready_median_s": statistics.median(s for s, _ in samples),
                         "rss_bytes": int(statistics.median(r for _, r in samples))}
        row["start_ratio"] = row["container"]["start_to_ready_s"] / row["process"]["start_to_ready_s"]
        row["rss_ratio"] = row["container"]["rss_bytes"] / row["process"]["rss_bytes"]
        result[layout] = row
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.image", description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=3, help="starts of each case (the best start counts)")
    parser.add_argument("--image", help="default: the version tag make image builds")
    args = parser.parse_args(argv)
    missing = podman_missing()
    if missing:
        print(f"bench.image: {missing}", file=sys.stderr)
        return 1
    image = args.image or image_tag()
    figures = measure(args.starts, image)
    stored = json.loads(FIGURES.read_text()) if FIGURES.exists() else {}
    stored["runtime"] = figures | {"when": time.time()}
    FIGURES.write_text(json.dumps(stored, indent=2) + "\n")
    for layout in ("collapsed", "layered"):
        row = figures[layout]
        print(f"{layout:9}  start to ready: process {row['process']['start_to_ready_s']:.2f}s, container "
              f"{row['container']['start_to_ready_s']:.2f}s (x{row['start_ratio']:.2f});  RSS: process "
              f"{row['process']['rss_bytes'] / 2**20:.0f} MiB, container {row['container']['rss_bytes'] / 2**20:.0f} MiB "
              f"(x{row['rss_ratio']:.2f})")
    print(f"wrote {FIGURES.relative_to(ROOT)} (runtime)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
