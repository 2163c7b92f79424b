"""The controller process: the sqlite state, the MigrationControl server and the tick loop.

    python -m migration.runner --db PATH --listen unix:PATH --admin-token-file PATH

It binds only to a unix socket or loopback, re-applies the persisted stage on start (see
`Controller.open`), ticks every ~100 ms (so a failing gate's rollback reaches the data path
well within a second) and exits cleanly on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import stat
import sys
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from migration.admin_token import read_admin_token
from migration.controller import Controller
from migration.recording import RecordingTarget
from migration.service import SERVICE_NAME, MigrationService
from migration.target import TrafficTarget
from services.common import Clock, ConfigError
from spine.runtime.signals import Termination
from spine.v1 import migration_pb2, migration_pb2_grpc

log = logging.getLogger("spine.migration")


def check_listen(listen: str, allow_external: bool = False) -> str:
    """`unix:PATH` or a loopback `host:port`; anything that could face a network is refused
    unless `allow_external` (a pod address in a cluster, where the admin token guards it)."""
    if listen.startswith("unix:"):
        if not listen[len("unix:"):]:
            raise ConfigError("--listen: unix: needs a socket path, e.g. unix:/run/spine/migration.sock")
        return listen
    host, sep, port = listen.rpartition(":")
    host = host.strip("[]")
    if not sep or not port.isdigit():
        raise ConfigError(f"--listen: expected unix:PATH or HOST:PORT, got {listen!r}")
    if host != "localhost" and not allow_external:
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ConfigError(f"--listen: the controller binds to loopback or a unix socket only, got {listen!r}")
    return listen


class ControllerProcess:
    """Controller + gRPC server + tick thread, started and stopped together."""

    def __init__(self, db_path: str, listen: str, admin_token: str, target: TrafficTarget, *,
                 tick_s: float = 0.1, clock: Clock = time.time, allow_external: bool = False) -> None:
        self.listen = check_listen(listen, allow_external)
        self.controller = Controller.open(db_path, target, clock=clock)
        self.service = MigrationService(self.controller, admin_token)
        self._tick_s = tick_s
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick_loop, name="migration-tick", daemon=True)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="migration"))
        migration_pb2_grpc.add_MigrationControlServicer_to_server(self.service, self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (migration_pb2.DESCRIPTOR.services_by_name["MigrationControl"].full_name,
                 health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self.server)
        self.port = 0

    def start(self) -> None:
        _remove_stale_socket(self.listen)
        self.port = self.server.add_insecure_port(self.listen)
        if not self.listen.startswith("unix:") and self.port == 0:
            raise ConfigError(f"--listen: could not bind {self.listen}")
        self.server.start()
        for service in ("", SERVICE_NAME):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._ticker.start()
        log.info("migration controller listening on %s", self.listen)

    def stop(self, grace: float = 1.0) -> None:
        self._stop.set()
        self.health.enter_graceful_shutdown()
        self.service.close()
        self.server.stop(grace).wait()
        if self._ticker.is_alive():
            self._ticker.join()
        self.controller.close()
        _remove_stale_socket(self.listen)

    def _tick_loop(self) -> None:
        while not self._stop.wait(self._tick_s):
            try:
                self.controller.tick()
            except Exception:  # a flaky data path must not stop the loop; the next tick retries
                log.exception("migration tick failed; retrying")


def _remove_stale_socket(listen: str) -> None:
    if not listen.startswith("unix:"):
        return
    path = listen[len("unix:"):]
    try:
        if stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass


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
