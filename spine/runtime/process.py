"""One component in its own process: the layered layout's building block.

    python -m spine.runtime.process COMPONENT --listen unix:/run/spine/auth.sock --config run/config.yaml

The process makes its own device context, serves the component behind a real gRPC
server (with health and reflection), and on SIGTERM stops accepting, finishes what it
accepted and flushes (logs, metrics) before it exits. It dies with its supervisor.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
from pathlib import Path

from services.registry import COMPONENTS, DEFAULT, close_servicer

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies: no orphans, ever."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m spine.runtime.process", description=__doc__)
    parser.add_argument("component", choices=COMPONENTS)
    parser.add_argument("--listen", required=True, help="unix:/path or 127.0.0.1:PORT")
    parser.add_argument("--config", required=True, help="the run's merged config YAML")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--parent-pid", type=int, default=0)
    parser.add_argument("--allow-external", action="store_true",
                        help="listen beyond loopback (a pod address in a cluster)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)

    die_with_parent()
    if args.parent_pid and os.getppid() != args.parent_pid:
        return 1  # the supervisor died before we could ask to die with it

    from monolith.device import DeviceContext
    from monolith.runtime_env import configure_threads
    from services.common import section
    from services.inference_config import InferenceConfig
    from services.pipeline.verdicts import RequestLimits
    from spine.runtime.config import load_config
    from spine.runtime.health import start_deep_health
    from spine.runtime.server import start_server
    from spine.runtime.signals import Termination
    from spine.runtime.tracing import install_from_config

    termination = Termination()  # before serving: a SIGTERM from now on flushes before exit
    configure_threads()
    config = load_config(args.config)
    install_from_config(config, service_name=args.component)  # continue traces from the gateway
    run_dir = Path(args.run_dir)
    spec = DEFAULT[args.component]
    servicer = spec.build(config, DeviceContext.from_config(config), run_dir)
    from spine.runtime.foreign import envoy_apis_of

    server = start_server([(spec, servicer), *envoy_apis_of(spec, servicer, config)], args.listen,
                          max_message_bytes=RequestLimits.from_config(config).max_message_bytes,
                          allow_external=args.allow_external)
    # Deep health: SERVING only while the component can do its work (for inference: a tiny
    # forward on its device within a bound), so the supervisor, the gates and xDS
    # endpoints see a broken device, not just a live process.
    inference = InferenceConfig.from_dict(section(config, "inference"))
    deep = start_deep_health(server, servicer, inference.health_interval_s, inference.health_timeout_s,
                             services=["", spec.full_name])
    extra = None
    if args.component == "metrics":
        from spine.runtime.metrics_endpoint import start_metrics_endpoint

        extra = start_metrics_endpoint(servicer, config, run_dir)

    print(f"{args.component} serving on {server.address}", flush=True)
    termination.wait()
    deep.stop()
    server.stop(grace=3.0)
    if extra is not None:
        extra.stop()
    close_servicer(servicer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
