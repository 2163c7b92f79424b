"""`spine up`: run a layout in the foreground until SIGTERM or Ctrl-C.

A config problem (`--config`) exits 2 with one line per problem, before anything starts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.bare import API_KEY_ENV, BARE_LAYOUT
from runtime.config.file import (
    LAYOUTS,
    SpineConfig,
    dev_api_key,
    load_config,
    placements_for,
    remote_addresses,
)
from runtime.stage_follower import ROLE_SPINE, add_follow_arguments, follow, spine_applier
from services.common import ConfigError

if TYPE_CHECKING:
    from runtime.config.sections import TlsConfig


def add_up_parser(sub: Any) -> None:
    up = sub.add_parser("up", help="run a layout in the foreground until SIGTERM or Ctrl-C")
    up.add_argument("--layout", choices=(*LAYOUTS, BARE_LAYOUT), default="collapsed",
                    help="collapsed (the spine), layered, mixed (config `placements`), or bare: the model alone "
                         "(the inference component behind the HTTP API and its gRPC Inference service, no middleware)")
    up.add_argument("--api-key-file", metavar="FILE",
                    help=f"--layout bare only: every request must carry this key (Authorization: Bearer KEY or "
                         f"x-api-key); default: the environment's {API_KEY_ENV}, else no key")
    up.add_argument("--listen", metavar="HOST:PORT", help="the gRPC Gateway API's address (default: config `listen`, 127.0.0.1:50051)")
    up.add_argument("--http-listen", metavar="HOST:PORT",
                    help="the OpenAI/Anthropic-compatible HTTP API's address (default: config `http.listen`, "
                         "127.0.0.1:8000); 'off': none")
    up.add_argument("--admin-token-file", metavar="FILE",
                    help="serve the admin API (keys managed at run time, spend: `spine keys`, HTTP /admin/) behind "
                         "the token in FILE (mode 600); default: $SPINE_ADMIN_TOKEN when set, else no admin API")
    up.add_argument("--run-dir", help="sockets, logs and state (default: a fresh temporary directory)")
    up.add_argument("--allow-external", action="store_true", help="allow a non-loopback --listen")
    up.add_argument("--probe-listen", metavar="HOST:PORT",
                    help="also answer grpc.health.v1 alone, in plaintext, here (Kubernetes' grpc probes cannot "
                         "speak TLS)")
    up.add_argument("--model", metavar="DIR", help="serve this transformers causal LM directory as the default "
                                                 "model (alias `default`) instead of the config's; `sim`: the "
                                                 "device-time simulator (a directory named sim: ./sim)")
    up.add_argument("--model-id", help="the id --model is served under (default: the directory's name)")
    up.add_argument("--deterministic", action="store_true",
                    help="deterministic mode, as `inference.deterministic: true`: deterministic kernels, and a sampled "
                         "request without a seed uses inference.seed, so answers are bit-identical across runs, "
                         "batches and layouts")
    add_follow_arguments(up, "each stage's placements (moved live) and this spine's share of every limit")
    from runtime.faults import INJECTABLE

    up.add_argument("--inject-fault", choices=INJECTABLE,
                    help="REHEARSALS AND TESTS ONLY (refused with --allow-external): run with a fault on purpose; "
                         "wrong-answers: the parity fault, greedy requests are sampled and every call succeeds "
                         "(python -m spine.tools.rehearsal.run); switchable: no fault until the parent process "
                         "switches one with a line on stdin (`error-rate R`, `wrong-answers on|off`, `clear`; "
                         "make run)")
    up.set_defaults(handler=cmd_up)


def cmd_up(args: argparse.Namespace) -> int:
    from monolith.runtime_env import configure_threads, freeze_startup_heap, prefer_huge_pages

    prefer_huge_pages()  # before anything imports torch
    from runtime.observability.tracing import install_for
    from runtime.processes.signals import Termination
    from runtime.stack import Stack

    config = load_config(args.config, _up_overrides(args))
    if args.layout == BARE_LAYOUT:
        return _up_bare(args, config)
    if args.api_key_file:
        raise ConfigError("--api-key-file: only for --layout bare (the other layouts' keys are the auth section's)")
    placements = placements_for(args.layout, config)
    listen = args.listen or config.listen
    http_listen = args.http_listen or config.http.listen
    if args.http_listen == "off":
        http_listen = None
    _check_addresses(args, listen, http_listen)  # before any child process starts
    run_dir = Path(args.run_dir) if args.run_dir else None
    config = startable(config)
    tls = _serve_tls(config)
    fault = _injected_fault(args, config, run_dir)
    # The process becomes a server only now, every check passed: its torch threads, CPU
    # placement and tracing are set for the stack it is about to start. Set before the
    # checks, a caller whose `up` was refused (a test calling `main` in its own interpreter)
    # kept them, and its next in-process model pinned all of its threads to one CPU.
    configure_threads()
    install_for(config.tracing, service_name="spine")
    spec = Stack(config, placements, listen=listen, run_dir=run_dir, allow_external=args.allow_external,
                 remote_addresses=remote_addresses(config), probe_listen=args.probe_listen,
                 http_listen=http_listen, admin_token=_admin_token(args), **fault)
    termination = Termination()
    stack = spec.start()
    follower = follow(args, ROLE_SPINE, spine_applier(stack), "serving on this config's placements", tls)
    key = dev_api_key(config)
    ready = {
        "event": "ready", "layout": stack.layout, "address": stack.address, "http_address": stack.http_address,
        "pid": os.getpid(),
        "placements": dict(stack.placements), "run_dir": str(stack.run_dir), "metrics": stack.metrics_address(),
        "children": stack.supervisor.pids() if stack.supervisor else {},
        # The gateway's health and each component's; later flips, restarts and crash loops
        # are logged (one line each) on stderr.
        "health": stack.health_report(),
        "admin_api": stack.admin is not None,
        # Envoy's APIs, on their own listener only (`envoy_api.listen`; null: not served here).
        "envoy_address": stack.envoy_server.address if stack.envoy_server is not None else None,
    }
    if follower is not None:  # the controller's stage, as applied (placements above include it)
        ready["follower"] = follower.state()
    if args.inject_fault:
        ready["injected_fault"] = args.inject_fault
    freeze_startup_heap()  # see its docstring: no full collection walks the startup heap again
    print(json.dumps(ready), flush=True)
    if fault.get("hooks"):  # `switchable`: the parent switches the fault through our stdin
        from runtime.faults import FaultSwitch

        def answer(line: str) -> None:  # one write: a whole line, whatever else prints to stdout
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

        FaultSwitch(fault["hooks"][0], answer).follow(
            sys.stdin.buffer, lambda: print("--inject-fault switchable: stdin closed; the fault stays as it is",
                                            file=sys.stderr))
    print(f"spine {stack.layout} layout serving the Gateway API on {stack.address}", file=sys.stderr)
    if stack.http_address:
        scheme = "https" if tls is not None else "http"
        print(f"HTTP API (OpenAI/Anthropic-compatible) on {scheme}://{stack.http_address}/v1", file=sys.stderr)
    if key:
        print(f"dev tenant API key: {key}   (try: spine call --address {stack.address} --prompt hello)",
              file=sys.stderr)
    try:
        termination.wait()
    finally:
        print("stopping: finishing in-flight requests, flushing logs and metrics", file=sys.stderr)
        if follower is not None:
            follower.stop()
        stack.stop()
    return 0


def startable(config: SpineConfig) -> SpineConfig:
    """The checks `spine up` runs on a config beyond reading it, before anything starts — also
    `spine config check`'s, so a config that passes the check is one `up` accepts: an hf model
    directory (its architecture, context and weights against the device budget, sized for the
    CPU when its budget is auto, said once), and the `tls:` files. ConfigError: one line, exit 2."""
    from runtime.config.model_fit import fit_to_model
    from runtime.config.served_model import preflight
    from runtime.tls import load_certificates

    config, fitted = fit_to_model(config)
    if fitted:
        print(fitted, file=sys.stderr, flush=True)
    preflight(config)
    if config.tls is not None:
        load_certificates(config.tls)
    return config


def _check_addresses(args: argparse.Namespace, listen: str, http_listen: str | None) -> None:
    """Every address `up` will listen on: well formed, loopback unless --allow-external, and free
    now (AddressError: one line, exit 2, before anything starts)."""
    from runtime.server import check_free, check_listen

    addresses = [("--listen", listen), ("--http-listen", http_listen), ("--probe-listen", args.probe_listen)]
    for flag, address in addresses:
        if address is not None:
            check_listen(address, args.allow_external, flag)
    for flag, address in addresses:
        if address is not None:
            check_free(address, flag)


def _admin_token(args: argparse.Namespace) -> str | None:
    """The admin token from --admin-token-file or $SPINE_ADMIN_TOKEN; None when neither is given."""
    from services.common.admin_token import ENV_VAR, read_admin_token

    if not args.admin_token_file and not os.environ.get(ENV_VAR, "").strip():
        return None
    return read_admin_token(args.admin_token_file)


def _up_bare(args: argparse.Namespace, config: SpineConfig) -> int:
    """`spine up --layout bare`: the model alone (`runtime.bare`), with the same ready line."""
    from monolith.runtime_env import configure_threads, freeze_startup_heap
    from runtime.bare import BareServer
    from runtime.processes.signals import Termination

    for flag, given in (("--inject-fault", args.inject_fault), ("--follow-controller", args.follow_controller)):
        if given:
            raise ConfigError(f"{flag}: not with --layout bare (the model alone has no middleware and no stages)")
    listen = args.listen or config.listen
    http_listen = None if args.http_listen == "off" else (args.http_listen or config.http.listen)
    _check_addresses(args, listen, http_listen)
    config = startable(config)
    tls = _serve_tls(config)
    key = _api_key(args)
    configure_threads()
    termination = Termination()
    server = BareServer(config, listen=listen, http_listen=http_listen,
                        run_dir=Path(args.run_dir) if args.run_dir else None, api_key=key, tls=tls,
                        allow_external=args.allow_external, probe_listen=args.probe_listen).start()
    metrics = (server.run_dir / "inference.metrics.addr")
    freeze_startup_heap()
    print(json.dumps({"event": "ready", "layout": BARE_LAYOUT, "address": server.address,
                      "http_address": server.http_address, "pid": os.getpid(), "run_dir": str(server.run_dir),
                      "metrics": metrics.read_text().strip() if metrics.exists() else None,
                      "api_key": key is not None, "children": {}}), flush=True)
    print(f"spine bare (the model alone) serving the Inference API on {server.address}", file=sys.stderr)
    if server.http_address:
        scheme = "https" if tls is not None else "http"
        print(f"HTTP API (OpenAI/Anthropic-compatible) on {scheme}://{server.http_address}/v1", file=sys.stderr)
    try:
        termination.wait()
    finally:
        print("stopping: finishing in-flight requests", file=sys.stderr)
        server.stop()
    return 0


def _api_key(args: argparse.Namespace) -> str | None:
    """The bare server's key: `--api-key-file` (its first line), else the environment's, else none."""
    if args.api_key_file:
        try:
            key = Path(args.api_key_file).read_text().strip()
        except OSError as error:
            raise ConfigError(f"--api-key-file: cannot read {args.api_key_file}: {error.strerror}") from None
        if not key:
            raise ConfigError(f"--api-key-file: {args.api_key_file} is empty")
        return key
    return os.environ.get(API_KEY_ENV) or None


def _serve_tls(config: SpineConfig) -> TlsConfig | None:
    """The config's `tls:` section, its files checked before anything starts (ConfigError: one
    line, exit 2); refused handshakes logged as one line each and SIGHUP re-reading the files."""
    from runtime.tls import load_certificates, reload_on_sighup

    tls = config.tls
    if tls is None:
        return None
    load_certificates(tls)
    from runtime.core_log import log_tls_refusals

    log_tls_refusals()
    reload_on_sighup()
    return tls


def _injected_fault(args: argparse.Namespace, config: SpineConfig, run_dir: Path | None) -> dict[str, Any]:
    """`--inject-fault NAME` (rehearsals and tests only): the Stack arguments that switch it on."""
    if not args.inject_fault:
        return {}
    if args.allow_external:
        raise ConfigError("--inject-fault: for local rehearsals and tests only; refused with --allow-external")
    from runtime.faults import SWITCHABLE

    if args.inject_fault == SWITCHABLE and sys.stdin.isatty():
        raise ConfigError("--inject-fault switchable: its switches are read from stdin, a terminal here (every "
                          "line typed would switch a fault); start it from a program that holds a pipe to it, "
                          "as make run does")
    from runtime.faults import injected_fault

    print(f"warning: --inject-fault {args.inject_fault}: this spine misbehaves on purpose (rehearsals and tests "
          f"only)", file=sys.stderr)
    return injected_fault(args.inject_fault, config, run_dir)


def _up_overrides(args: argparse.Namespace) -> dict[str, Any] | None:
    """`--model DIR [--model-id ID]` and `--deterministic`, as config overrides."""
    overrides = served_model(args) or {}
    if args.deterministic:  # the same as `inference.deterministic: true` in the config
        from runtime.config.file import merge

        overrides = merge(overrides, {"inference": {"deterministic": True}})
    return overrides or None


def served_model(args: argparse.Namespace) -> dict[str, Any] | None:
    """`--model DIR [--model-id ID]`: config overrides serving DIR as the default model."""
    if not args.model:
        if args.model_id:
            raise ConfigError("--model-id: needs --model DIR")
        return None
    from runtime.config.served_model import model_overrides

    return model_overrides(args.model, args.model_id)
