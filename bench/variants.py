"""`python -m bench.variants`: the collapsed spine under several values of one setting, or built from
several checkouts of the code, side by side.

    python -m bench.variants --vary batching.max_wait_us=0,10000 [--concurrency 64] [--requests 1200]
                             [--rounds 6] [--stream]
    python -m bench.variants --tree ../spine-change [--tree ...] [--concurrency 16,64] [--http] [--device]
                             [--layout layered]

Why: a change to the request path is judged against bare in one run, but a full `make bench`
takes minutes and its ratios move between runs on a shared host by more than most single
changes. This starts bare and one collapsed spine per value of the setting (the bench's
config plus that one setting), all at once, and measures them the way `make bench` does —
cells cut into rounds, the servers taking turns in a rotating order — so every value meets
the same host noise. It prints, per cell, each variant's p50, p99 and throughput against
bare and its server CPU per request by thread (handlers — gRPC's and the HTTP API's — the
HTTP loop, model, completions, and the total: what a change to the request path moves even
when the host hides it in throughput).

`--tree PATH` adds a collapsed spine run from another checkout (a `git worktree` of a change,
say) with the bench's config, next to this checkout's: a change to the code judged against
the code it changes in the same run, which is how a change worth a few percent has to be
judged on this host (separate runs of the same build read several percent apart). Its generated
protobuf modules are made first if it has none, as `make protos` would.

`--layout layered` runs every variant as the layered stack instead (its gateway and one
process per middleware, the OS placing them): a change to the layered gateway's path
(its hops, how it awaits them) judged the same way.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from bench.device_regime import DEVICE_OVERLAY
from bench.http_load import HttpEndpoint
from bench.load import Endpoint
from bench.regime import measure, tear_down, warm_up, write_configs
from bench.report import _fmt, add_ratios
from bench.settings import DEV_KEY, STREAM_REQUESTS, Settings
from bench.targets import (
    REPO_ROOT,
    Target,
    TargetFailed,
    keep_load_generator_off,
    launch,
    server_cpu,
)
from runtime.config.file import load_config, merge
from runtime.config.served_model import model_id_for
from services.common import ConfigError
from spine.tools.tree_sampler import TreeSampler


def parse_vary(spec: str) -> tuple[str, list[Any]]:
    """`section.key=v1,v2,...` → (dotted key, values as YAML scalars)."""
    key, sep, values = spec.partition("=")
    parts = [part.strip() for part in values.split(",") if part.strip()]
    if not sep or not key.strip() or "." not in key or len(parts) < 1:
        raise ValueError(f"--vary: expected section.key=value1,value2 (e.g. batching.max_wait_us=0,10000), "
                         f"got {spec!r}")
    return key.strip(), [yaml.safe_load(part) for part in parts]


def overlay_for(key: str, value: Any) -> dict[str, Any]:
    """The config overlay that sets dotted `key` to `value`."""
    overlay: dict[str, Any] = {}
    node = overlay
    *sections, last = key.split(".")
    for section in sections:
        node = node.setdefault(section, {})
    node[last] = value
    return overlay


def variant_configs(run_dir: Path, base: Path, key: str, values: list[Any]) -> dict[str, Path]:
    """One config file per value (the bench's overlay plus the setting), each checked first:
    a key or value the config refuses is one line, before any server starts."""
    base_config = yaml.safe_load(base.read_text()) or {}
    configs: dict[str, Path] = {}
    for value in values:
        name = f"{key}={value}"
        path = run_dir / f"variant-{len(configs)}.yaml"
        path.write_text(yaml.safe_dump(merge(base_config, overlay_for(key, value))))
        load_config(path)  # ConfigError names the field
        configs[name] = path
    return configs


def tree_variants(paths: list[str]) -> dict[str, Path]:
    """`tree:<folder name>` → each checkout's root, checked first (ValueError: one line)."""
    trees: dict[str, Path] = {}
    for given in paths:
        root = Path(given).expanduser().resolve()
        if not (root / "spine" / "__main__.py").is_file() or not (root / "protos").is_dir():
            raise ValueError(f"--tree {given}: not a checkout of spine (no spine/__main__.py and protos/ there)")
        name = f"tree:{root.name}"
        if name in trees or root == REPO_ROOT:
            raise ValueError(f"--tree {given}: named twice, or this checkout itself (always measured)")
        trees[name] = root
    return trees


def generate_protos(root: Path) -> None:
    """The checkout's protobuf modules from its own protos, as `make protos` makes them
    (a fresh worktree has none: they are build outputs, not in git)."""
    protos = sorted(str(path.relative_to(root)) for path in (root / "protos").rglob("*.proto"))
    if not protos:
        raise ValueError(f"--tree {root}: no .proto files under protos/")
    # Where the stubs go follows the tree's own proto paths (protos/wire/v1 -> wire/v1; an
    # older tree's protos/spine/v1 -> spine/v1).
    out = root / Path(protos[0]).relative_to("protos").parent
    if (out / ".generated").exists():
        return
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", "protos", "--python_out=.", "--pyi_out=.",
                    "--grpc_python_out=.", *protos], cwd=root, check=True, capture_output=True, text=True)
    (out / "__init__.py").touch()
    (out / ".generated").touch()


def print_variants(runs: list[dict[str, Any]], console: Console, layout: str = "collapsed") -> None:
    """Each run against bare (`add_ratios`' ratios; TTFT's here) and its CPU by thread."""
    add_ratios(runs)
    bare = {(run["mode"], run["concurrency"]): run for run in runs if run["layout"] == "bare"}
    table = Table(title=f"variants of the {layout} layout (ratios: variant / bare, same cell)")
    for column in ("mode", "conc", "variant", "p50 ×bare", "p99 ×bare", "rps ×bare", "TTFT ×bare",
                   "handlers µs", "loop µs", "model µs", "completions µs", "total µs"):
        table.add_column(column, justify="left" if column in ("mode", "variant") else "right",
                         min_width=26 if column == "variant" else None)  # a variant's name is never cut
    for run in runs:
        base = bare[(run["mode"], run["concurrency"])]
        threads = run.get("cpu_us_per_request_by_thread") or {}
        ttft = (f"{run['ttft_p50_ms'] / base['ttft_p50_ms']:.3f}"
                if run["mode"] == "stream" and run.get("ttft_p50_ms") and base.get("ttft_p50_ms") else "")
        table.add_row(run["mode"], str(run["concurrency"]), run["layout"],
                      *(_fmt(run[ratio], 3) for ratio in ("p50_vs_bare", "p99_vs_bare", "rps_vs_bare")), ttft,
                      f"{threads.get('handlers', 0) + threads.get('http-handlers', 0):.0f}",
                      *(f"{threads.get(group, 0):.0f}" for group in ("http-loop", "model", "completions")),
                      f"{sum(threads.values()):.0f}")
    console.print(table)


def _endpoint(target: Target, http: bool) -> Endpoint | HttpEndpoint:
    """How the bench calls `target`: a spine over HTTP where asked (the HTTP API's path to the
    model is the one a change to the request loop moves), else over gRPC."""
    if http and target.is_gateway and target.http_address is not None:
        return HttpEndpoint(target.http_address, DEV_KEY)
    return Endpoint(target.address, target.is_gateway, DEV_KEY)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.variants", description=__doc__.splitlines()[0])
    parser.add_argument("--vary", help="section.key=value1,value2,... (YAML scalars)")
    parser.add_argument("--tree", action="append", default=[], metavar="PATH",
                        help="also a collapsed spine run from this checkout (repeatable)")
    parser.add_argument("--concurrency", default="64", help="comma-separated worker counts (default 64)")
    parser.add_argument("--requests", type=int, default=1200, help="unary requests per cell and server")
    parser.add_argument("--rounds", type=int, default=6, help="interleaved turns per cell")
    parser.add_argument("--stream", action="store_true", help="also a GenerateStream cell at concurrency 1")
    parser.add_argument("--stream-requests", type=int, default=STREAM_REQUESTS)
    parser.add_argument("--device", action="store_true",
                        help="the device regime's model (the simulator, its batch sizes: bench.device_regime)")
    parser.add_argument("--layout", choices=("collapsed", "layered"), default="collapsed",
                        help="the layout every variant runs (default collapsed)")
    parser.add_argument("--http", action="store_true",
                        help="call the variants over their HTTP API (POST /v1/completions), bare over gRPC")
    args = parser.parse_args(argv)
    if not args.vary and not args.tree:
        parser.error("give --vary section.key=value1,value2 or --tree PATH (or both)")
    try:
        key, values = parse_vary(args.vary) if args.vary else ("", [])
        trees = tree_variants(args.tree)
        concurrency = tuple(sorted({int(part) for part in args.concurrency.split(",") if part.strip()}))
    except ValueError as error:
        parser.error(str(error))
    if not concurrency or min(concurrency) < 1 or args.requests < 1 or args.rounds < 1:
        parser.error("--concurrency, --requests and --rounds must be positive")
    settings = Settings(concurrency=concurrency, requests=args.requests, stream_requests=args.stream_requests,
                        rounds=min(args.rounds, args.requests), max_tokens=8, cell_time_limit_s=60.0, warmup=6,
                        ready_timeout_s=120.0, quick=False, fixed_rounds=True)
    if args.device:  # the simulator and the device regime's batch sizes, as `make bench`'s device regime
        settings = replace(settings, model="sim", model_id=model_id_for("sim"))
    console = Console() if sys.stdout.isatty() else Console(width=220)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    run_dir = Path(tempfile.mkdtemp(prefix="spv-"))  # short: unix socket paths are limited to ~107 bytes
    targets: dict[str, Target] = {}
    endpoints: dict[str, Endpoint | HttpEndpoint] = {}
    sampler: TreeSampler | None = None
    try:
        configs = (write_configs(run_dir, settings.model, settings.model_id, extra=DEVICE_OVERLAY) if args.device
                   else write_configs(run_dir))
        try:
            variants = {name: (path, REPO_ROOT)
                        for name, path in variant_configs(run_dir, configs[args.layout], key, values).items()}
        except ConfigError as error:
            console.print(f"[red]{error}[/red]")
            return 2
        if trees and not values:
            variants[args.layout] = (configs[args.layout], REPO_ROOT)
        for name, root in trees.items():
            try:
                generate_protos(root)
            except ValueError as error:
                console.print(str(error), style="red", markup=False, highlight=False)
                return 2
            except subprocess.CalledProcessError as error:
                console.print(f"{name}: its protos do not compile: {error.stderr.strip()[-500:]}", style="red",
                              markup=False, highlight=False)
                return 2
            variants[name] = (configs[args.layout], root)
        targets["bare"] = launch("bare", run_dir, configs["bare"])
        for i, (name, (path, code)) in enumerate(variants.items()):
            where = run_dir / f"v{i}"
            where.mkdir()
            targets[name] = launch(args.layout, where, path, code=code)
        for name, target in targets.items():
            try:
                target.wait_ready(settings.ready_timeout_s)
            except TargetFailed as error:  # a checkout that does not start: say which
                console.print(f"{name}: {error}", style="red", markup=False, highlight=False)
                return 1
        keep_load_generator_off(server_cpu())
        endpoints = {name: _endpoint(t, args.http) for name, t in targets.items()}
        sampler = TreeSampler({name: target.pid for name, target in targets.items()}, interval_s=0.25).start()
        warm_up(endpoints, settings)
        runs = measure(endpoints, targets, sampler, settings, console, stream=args.stream)
    finally:
        tear_down(sampler, endpoints, targets, console)
        shutil.rmtree(run_dir, ignore_errors=True)
    print_variants(runs, console, args.layout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
