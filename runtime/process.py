"""One component in its own process: the layered layout's building block.

    python -m runtime.process COMPONENT --listen unix:/run/spine/auth.sock --config run/config.yaml

The process makes its own device context, serves the component behind a real gRPC
server (with health and reflection), and on SIGTERM stops accepting, finishes what it
accepted and flushes (logs, metrics) before it exits. It dies with its supervisor. A
middleware is served from one event loop (`runtime.loop_server`: its handlers inline, no
thread per call); the model from a thread-pool server sized for its queue (`runtime.server`).

A layered rate limiter can follow the migration controller (`--follow-controller
HOST:PORT`, its xDS address): each stage sets its share of every limit (its side's share
divided by the rate limiters of that side), so a tenant's total across both sides and all
replicas stays within its limit. It waits up to `--initial-fetch-timeout-s` for its first
share before it starts serving.

With a `tls:` section in its config and a TCP `--listen` (a pod address in Kubernetes) it
serves mTLS; on a unix socket (the local supervisor's children) it stays plaintext.
`--probe-listen` answers health alone in plaintext, for Kubernetes' grpc probes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from runtime.processes.parent import die_with_parent, follow_parent
from runtime.stage_follower import (
    ROLE_LAYERED_RATELIMIT,
    add_follow_arguments,
    follow,
    ratelimit_applier,
)
from services.registry import COMPONENTS, DEFAULT, close_servicer


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m runtime.process", description=__doc__)
    parser.add_argument("component", choices=COMPONENTS)
    parser.add_argument("--listen", required=True, help="unix:/path or 127.0.0.1:PORT")
    parser.add_argument("--config", required=True, help="the run's merged config YAML")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--allow-external", action="store_true",
                        help="listen beyond loopback (a pod address in a cluster)")
    parser.add_argument("--probe-listen", metavar="HOST:PORT",
                        help="also answer grpc.health.v1 alone, in plaintext, here (Kubernetes' grpc probes "
                             "cannot speak TLS)")
    add_follow_arguments(parser, "this rate limiter's share of every limit (ratelimit only)")
    return parser


def main(argv: list[str] | None = None) -> int:
    from services.common import ConfigError

    try:
        return serve(argv)
    except ConfigError as error:  # a config or certificate file that cannot be used: one line
        for line in getattr(error, "problems", None) or str(error).splitlines():
            print(f"config error: {line}", file=sys.stderr)
        return 2


def serve(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.follow_controller and args.component != "ratelimit":
        parser.error(f"--follow-controller: only ratelimit follows the controller's stages, not {args.component}")

    die_with_parent()  # started by hand too: it goes with whatever started it
    if not follow_parent():
        return 1  # started by `spawn` (the supervisor), whose process died before we could ask

    from monolith.runtime_env import configure_threads, freeze_startup_heap, prefer_huge_pages

    prefer_huge_pages()  # before anything imports torch, whoever started this process
    from monolith.device_on_use import DeviceOnFirstUse
    from runtime.config.file import load_config
    from runtime.health.deep import start_deep_health
    from runtime.loop_server import start_loop_server
    from runtime.observability.tracing import install_for
    from runtime.processes.signals import Termination
    from runtime.server import ServerHandle, request_pool, start_server
    from runtime.tls import is_unix, reload_on_sighup

    termination = Termination()  # before serving: a SIGTERM from now on flushes before exit
    configure_threads()
    config = load_config(args.config)
    if args.component == "inference":  # alone (bare): sized for its model as `spine up` sizes it
        from runtime.config.model_fit import fit_to_model

        config, fitted = fit_to_model(config)
        if fitted:
            print(fitted, file=sys.stderr, flush=True)
    install_for(config.tracing, service_name=args.component)  # continue traces from the gateway
    tls = config.tls
    if tls is not None and not is_unix(args.listen):
        from runtime.core_log import log_tls_refusals

        log_tls_refusals()  # a refused handshake: one spine.tls line in this child's log
        reload_on_sighup()
    run_dir = Path(args.run_dir)
    spec = DEFAULT[args.component]
    # Auth, the router and logs keep no tensors: their process never makes a device
    # context nor imports torch (most of their start, and of their memory). A component
    # whose code imported torch gets its context now, at start, not on its first request
    # (on CUDA, making one is the device's initialisation).
    device = DeviceOnFirstUse(config.device)
    servicer = spec.build(config, device, run_dir)
    if "torch" in sys.modules:
        device.make_now()
    # Its share first: a limiter that follows does not serve before it has one (or has waited).
    follower = follow(args, ROLE_LAYERED_RATELIMIT, ratelimit_applier(servicer), "serving the whole limit", tls)
    from runtime.allowed_peers import envoy_interceptors
    from runtime.placement.foreign import envoy_apis_of

    # Its Envoy API beside its own service, on its internal listener; over mTLS, to the
    # peers `envoy_api.allowed_peers` names when it names any (the component's own service
    # is the deployment's: the gateway calls it with its own certificate).
    envoy = envoy_apis_of(spec, servicer, config)
    mtls = tls is not None and tls.client_ca_file is not None and not is_unix(args.listen)
    served = [(spec, servicer), *envoy]
    interceptors = envoy_interceptors(config.envoy_api.allowed_peers, envoy, mtls)
    limit = config.limits.max_message_bytes
    # A middleware's handlers are microseconds of CPU: served inline from one event loop
    # (`runtime.loop_server`). The model's handlers wait for the model: a thread each, sized
    # for its queue and slots, so requests wait in its priority queue, not in the pool's FIFO.
    server: ServerHandle
    if spec.middleware:
        server = start_loop_server(served, args.listen, max_message_bytes=limit, allow_external=args.allow_external,
                                   tls=tls, probe_listen=args.probe_listen, interceptors=interceptors)
    else:
        server = start_server(served, args.listen, max_message_bytes=limit, allow_external=args.allow_external,
                              tls=tls, probe_listen=args.probe_listen, interceptors=interceptors,
                              **request_pool(config.inference))
    # Deep health: SERVING only while the component can do its work (for inference: a tiny
    # forward on its device within a bound), so the supervisor, the gates and xDS
    # endpoints see a broken device, not just a live process.
    inference = config.inference
    deep = start_deep_health(server, servicer, inference.health_interval_s, inference.health_timeout_s,
                             services=["", spec.full_name])
    extra = None
    if args.component == "metrics":
        from runtime.observability.metrics_endpoint import start_metrics_endpoint

        extra = start_metrics_endpoint(servicer, config, run_dir)
    elif args.component == "inference":  # its serving metrics, on its own /metrics
        from runtime.observability.serving_metrics_export import serve_inference_metrics

        extra = serve_inference_metrics(servicer, config, run_dir)
    elif args.component in ("ratelimit", "auth"):  # their stores' families, on their own /metrics
        from runtime.observability.store_metrics import serve_store_metrics

        extra = serve_store_metrics(servicer, config, run_dir, args.component)

    freeze_startup_heap()  # see its docstring: no full collection walks the startup heap again
    print(f"{args.component} serving on {server.address}", flush=True)
    termination.wait()
    if follower is not None:
        follower.stop()
    deep.stop()
    server.stop(grace=3.0)
    if extra is not None:
        extra.stop()
    close_servicer(servicer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
