"""`spine`: bring up a layout, call it, run the demo, drive a migration.

    spine up --layout layered|collapsed|mixed [--listen HOST:PORT]
    spine call --prompt "hello" [--stream]
    spine demo
    spine migrate ...
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from services.common import ConfigError
from spine.config import LAYOUTS, load_config, placements_for

DEFAULT_ADDRESS = "127.0.0.1:50051"


def dev_api_key(config: Mapping[str, Any]) -> str | None:
    """The plain dev key from the config (dev configs only; production ones hold hashes)."""
    for entry in (config.get("auth") or {}).get("api_keys") or []:
        if isinstance(entry, Mapping) and entry.get("key"):
            return str(entry["key"])
    return None


def cmd_up(args: argparse.Namespace) -> int:
    from monolith.runtime_env import configure_threads
    from spine.runtime import Stack
    from spine.signals import Termination

    configure_threads()
    config = load_config(args.config)
    placements = placements_for(args.layout, config)
    listen = args.listen or str(config.get("listen", DEFAULT_ADDRESS))
    run_dir = Path(args.run_dir) if args.run_dir else None
    stack = Stack(config, placements, listen=listen, run_dir=run_dir, allow_external=args.allow_external)
    termination = Termination()
    stack.start()
    key = dev_api_key(config)
    ready = {
        "event": "ready", "layout": stack.layout, "address": stack.address, "pid": os.getpid(),
        "placements": dict(placements), "run_dir": str(stack.run_dir), "metrics": stack.metrics_address(),
        "children": stack.supervisor.pids() if stack.supervisor else {},
    }
    print(json.dumps(ready), flush=True)
    print(f"spine {stack.layout} layout serving the Gateway API on {stack.address}", file=sys.stderr)
    if key:
        print(f"dev tenant API key: {key}   (try: spine call --address {stack.address} --prompt hello)",
              file=sys.stderr)
    try:
        termination.wait()
    finally:
        print("stopping: finishing in-flight requests, flushing logs and metrics", file=sys.stderr)
        stack.stop()
    return 0


def cmd_call(args: argparse.Namespace) -> int:
    from spine.client import GatewayClient
    from spine.v1 import generation_pb2

    config = load_config(args.config)
    token = args.token or os.environ.get("SPINE_TOKEN") or dev_api_key(config)
    request = generation_pb2.GenerateRequest(model=args.model, prompt=args.prompt, max_tokens=args.max_tokens,
                                             temperature=args.temperature, priority=args.priority)
    if args.seed is not None:
        request.seed = args.seed
    with GatewayClient(args.address, token) as client:
        if args.stream:
            result = client.stream(request, timeout=args.timeout)
        else:
            result = client.generate(request, timeout=args.timeout)
    out = {
        "status": result.code.name, "details": result.details, "latency_ms": round(result.latency_s * 1000, 3),
        "text": result.text, "token_ids": result.token_ids, "trailing": result.trailing,
    }
    if result.first_chunk_s is not None:
        out["first_chunk_ms"] = round(result.first_chunk_s * 1000, 3)
    if args.json:
        print(json.dumps(out))
    else:
        print(f"status:  {out['status']}" + (f" ({result.details})" if result.details else ""))
        print(f"latency: {out['latency_ms']} ms   layout: {result.layout}   "
              f"request id: {result.trailing.get('x-request-id', '')}")
        if result.ok:
            print(f"answer:  {result.text!r}")
    return 0 if result.ok else 1


def cmd_demo(args: argparse.Namespace) -> int:
    from spine.demo import run_demo

    return run_demo(load_config(args.config))


def cmd_ab(args: argparse.Namespace) -> int:
    from spine.demo import run_layouts_side_by_side

    return run_layouts_side_by_side(load_config(args.config), count=args.count, concurrency=args.concurrency)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spine", description="Collapse a layered gRPC middleware stack.")
    parser.add_argument("--config", help="YAML config laid over the default (spine/default_config.yaml)")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run a layout in the foreground until SIGTERM or Ctrl-C")
    up.add_argument("--layout", choices=LAYOUTS, default="collapsed")
    up.add_argument("--listen", help="public address HOST:PORT (default: config `listen`)")
    up.add_argument("--run-dir", help="sockets, logs and state (default: a fresh temporary directory)")
    up.add_argument("--allow-external", action="store_true", help="allow a non-loopback --listen")
    up.set_defaults(handler=cmd_up)

    call = sub.add_parser("call", help="send one request and print the answer, status and latency")
    call.add_argument("--address", default=DEFAULT_ADDRESS)
    call.add_argument("--token", help="API key or JWT (default: $SPINE_TOKEN, else the dev key)")
    call.add_argument("--model", default="tiny-lm")
    call.add_argument("--prompt", default="Hello, spine!")
    call.add_argument("--max-tokens", type=int, default=16)
    call.add_argument("--temperature", type=float, default=0.0)
    call.add_argument("--seed", type=int)
    call.add_argument("--priority", type=int, default=0)
    call.add_argument("--stream", action="store_true")
    call.add_argument("--timeout", type=float, default=30.0)
    call.add_argument("--json", action="store_true")
    call.set_defaults(handler=cmd_call)

    ab = sub.add_parser("ab", help="one workload through the layered and collapsed layouts, side by side")
    ab.add_argument("--count", type=int, default=120, help="requests per layout")
    ab.add_argument("--concurrency", type=int, default=4)
    ab.set_defaults(handler=cmd_ab)

    demo = sub.add_parser("demo", help="the main job: both layouts side by side (`make run`)")
    demo.set_defaults(handler=cmd_demo)

    try:
        from migration.cli import add_migrate_parser
    except ImportError:
        add_migrate_parser = None  # type: ignore[assignment]
    if add_migrate_parser is not None:
        add_migrate_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return int(args.handler(args) or 0)
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
