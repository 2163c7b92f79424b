"""The controller process: the sqlite state, the MigrationControl server and the tick loop.

    python -m migration.runner --db PATH --listen unix:PATH --admin-token-file PATH

It binds only to a unix socket or loopback, re-applies the persisted stage on start (see
`Controller.open`), ticks every ~100 ms (so a failing gate's rollback reaches the data path
well within a second) and exits cleanly on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import logging
import sys

from migration.admin_token import read_admin_token
from migration.recording import RecordingTarget
from migration.server import ControllerProcess, check_listen
from migration.target import TrafficTarget
from services.common import ConfigError
from spine.runtime.signals import Termination

log = logging.getLogger("spine.migration")


def build_target(args: argparse.Namespace) -> TrafficTarget:
    if args.target == "recording":
        return RecordingTarget(args.recording_file)
    if args.target == "xds":
        return build_xds_target(args)
    raise ConfigError(f"--target: unknown target {args.target!r}")  # pragma: no cover - argparse choices


def build_xds_target(args: argparse.Namespace) -> TrafficTarget:
    """Weights over ADS to real data planes; gates on each side's Prometheus metrics."""
    from migration.prometheus_window import PrometheusWindow
    from migration.traffic.endpoint_health import EndpointHealth
    from migration.traffic.xds_target import XdsTarget
    from migration.xds import Endpoint, XdsControlPlane

    missing = [flag for flag, value in (("--xds-listen", args.xds_listen), ("--layered", args.layered),
                                        ("--spine", args.spine), ("--layered-metrics", args.layered_metrics),
                                        ("--spine-metrics", args.spine_metrics)) if not value]
    if missing:
        raise ConfigError(f"--target xds needs {', '.join(missing)}")

    def endpoints(addresses: list[str], flag: str) -> list[Endpoint]:
        result = []
        for address in addresses:
            host, sep, port = address.rpartition(":")
            if not sep or not port.isdigit():
                raise ConfigError(f"{flag}: expected HOST:PORT, got {address!r}")
            result.append(Endpoint(host, int(port)))
        return result

    check_listen(args.xds_listen, args.allow_external)
    plane = XdsControlPlane("spine-gateway", {"layered": endpoints(args.layered, "--layered"),
                                              "spine": endpoints(args.spine, "--spine")})
    plane.start(args.xds_listen)
    log.info("xDS (ADS) serving on %s", plane.address)
    # A gateway that is not SERVING is sent UNHEALTHY, so data planes stop picking it.
    health = EndpointHealth({"layered": args.layered, "spine": args.spine}, xds=plane).start()
    return XdsTarget(plane, PrometheusWindow(args.layered_metrics), PrometheusWindow(args.spine_metrics),
                     endpoint_health=health)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m migration.runner", description=__doc__.splitlines()[0])
    parser.add_argument("--db", required=True, help="sqlite file holding the rollout state")
    parser.add_argument("--listen", required=True, help="unix:PATH or a loopback HOST:PORT")
    parser.add_argument("--admin-token-file", help=f"file holding the admin token (else ${'SPINE_ADMIN_TOKEN'})")
    parser.add_argument("--target", choices=["recording", "xds"], default="recording",
                        help="the data path to drive (recording: a test double with healthy stats; "
                             "xds: Envoy/proxyless data planes over ADS, gates on Prometheus metrics)")
    parser.add_argument("--allow-external", action="store_true",
                        help="allow non-loopback listen addresses (in a cluster; the admin token guards the API)")
    parser.add_argument("--xds-listen", help="with --target xds: where ADS listens, HOST:PORT")
    parser.add_argument("--layered", action="append", default=[], help="with --target xds: a layered gateway HOST:PORT")
    parser.add_argument("--spine", action="append", default=[], help="with --target xds: a spine HOST:PORT")
    parser.add_argument("--layered-metrics", help="with --target xds: the layered side's Prometheus /metrics URL")
    parser.add_argument("--spine-metrics", help="with --target xds: the spine's Prometheus /metrics URL")
    parser.add_argument("--recording-file", help="with --target recording: append every apply to this JSON-lines file")
    parser.add_argument("--tick-s", type=float, default=0.1, help="seconds between reconcile ticks")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    try:
        token = read_admin_token(args.admin_token_file)
        target = build_target(args)
        process = ControllerProcess(args.db, args.listen, token, target, tick_s=args.tick_s,
                                    allow_external=args.allow_external)
        serve_stable = getattr(target, "serve_stable", None)
        if serve_stable is not None:  # after the controller re-applied whatever it recorded
            serve_stable()
        process.start()
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    Termination().wait()  # a handler that calls Event.set() can deadlock the main thread
    log.info("stopping migration controller")
    process.stop()
    close = getattr(target, "close", None)
    if close is not None:
        close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
