"""The controller process: the sqlite state, the MigrationControl server and the tick loop.

    python -m migration.runner --db PATH --listen unix:PATH --admin-token-file PATH

`--db` is a sqlite file (the embedded default) or a PostgreSQL DSN (`--db-dsn-file` where
it carries a password): any number of replicas share a PostgreSQL store (or, with
`--leader-elect`, a sqlite file on one machine) and elect a leader under a lease
(`--lease-duration-s`/`--lease-renew-deadline-s`/`--lease-retry-period-s`, 15/10/2 s):
only the leader ticks, takes operator writes and pushes stages; every state write is
fenced by its lease epoch (`migration.leadership`).

With `--target xds` each stage goes out over ADS (`--xds-listen`): weights to the data planes,
placements and rate-limit shares to the spine replicas and layered rate limiters that follow
the controller; the gates read PromQL from `--prometheus-url`, or scrape every
`--layered-metrics` / `--spine-metrics` URL (each repeatable) directly.

With `--target legacy-http` the from side is a foreign HTTP endpoint (`--legacy-http`, e.g. LiteLLM's
proxy): this process serves the HTTP front (`--front-listen`) that clients call instead, splitting
their traffic with the spine's HTTP API (`--spine-http`) by each stage's weight; the gates judge
both sides from what the front measures, and a plan must name the same endpoint (`legacy:`).

With `--tls-cert-file --tls-key-file [--tls-client-ca-file]` both listeners (MigrationControl
and xDS) speak TLS (mTLS with the client CA), and the gateways' health is asked over mTLS
with the same certificate. It binds only to a unix socket or loopback unless
`--allow-external`, and a listener beyond loopback without TLS is refused (exit 2): the admin
token would cross the network in plaintext. It re-applies the persisted stage on start (see
`Controller.open`), ticks every ~100 ms (so a failing gate's rollback reaches the data path
well within a second) and exits cleanly on SIGTERM or SIGINT.

`--dashboard-listen HOST:PORT` serves the operator's web view (`migration.dashboard`: the
stages, gate charts, layouts, audit and buttons; /metrics for the alert rules in
deploy/prometheus) with the same TLS; reading it needs the admin token unless
`--dashboard-view-without-token`. `--webhook-url URL` (repeatable) POSTs every transition,
signed with the secret in `--webhook-secret-file` (`migration.notify`).
"""

from __future__ import annotations

import argparse
import logging
import sys

from migration.admin_token import read_admin_token, read_secret_file
from migration.leadership import LeaseSettings
from migration.metrics.source import MetricsSource
from migration.notify import WebhookConfig
from migration.recording import RecordingTarget
from migration.server import ControllerProcess, check_listen
from migration.store_backends import StoreUnavailable, carries_password, is_postgres, redacted
from migration.target import TrafficTarget
from runtime.config.sections import TlsConfig
from runtime.observability.client_logs import quiet_http_clients
from runtime.processes.parent import follow_parent
from runtime.processes.signals import Termination
from runtime.server import AddressError, check_free
from services.common import ConfigError

log = logging.getLogger("spine.migration")


def build_target(args: argparse.Namespace) -> TrafficTarget:
    if args.target == "recording":
        return RecordingTarget(args.recording_file)
    if args.target == "xds":
        return build_xds_target(args)
    if args.target == "legacy-http":
        return build_legacy_target(args)
    raise ConfigError(f"--target: unknown target {args.target!r}")  # pragma: no cover - argparse choices


def build_xds_target(args: argparse.Namespace) -> TrafficTarget:
    """Weights over ADS to real data planes; gates on each side's metrics."""
    from migration.traffic.endpoint_health import EndpointHealth
    from migration.traffic.xds_target import XdsTarget
    from migration.xds import Endpoint, XdsControlPlane

    missing = [flag for flag, value in (("--xds-listen", args.xds_listen), ("--layered", args.layered),
                                        ("--spine", args.spine)) if not value]
    if missing:
        raise ConfigError(f"--target xds needs {', '.join(missing)}")
    for flag, value in (("--min-data-planes", args.min_data_planes), ("--min-spine-replicas", args.min_spine_replicas)):
        if value < 0:
            raise ConfigError(f"{flag}: must be >= 0, got {value}")
    metrics = build_metrics_source(args)

    def endpoints(addresses: list[str], flag: str) -> list[Endpoint]:
        result = []
        for address in addresses:
            host, sep, port = address.rpartition(":")
            if not sep or not port.isdigit():
                raise ConfigError(f"{flag}: expected HOST:PORT, got {address!r}")
            result.append(Endpoint(host, int(port)))
        return result

    tls = tls_of(args)
    try:
        check_listen(args.xds_listen, args.allow_external, tls, "--xds-listen")
        plane = XdsControlPlane("spine-gateway", {"layered": endpoints(args.layered, "--layered"),
                                                  "spine": endpoints(args.spine, "--spine")})
        plane.start(args.xds_listen, tls)
    except ConfigError:
        metrics.close()
        raise
    log.info("xDS (ADS) serving on %s%s", plane.address, " over TLS" if tls is not None else "")
    # A gateway that is not SERVING is sent UNHEALTHY, so data planes stop picking it.
    health = EndpointHealth({"layered": args.layered, "spine": args.spine}, xds=plane, tls=tls).start()
    return XdsTarget(plane, metrics, endpoint_health=health, min_data_planes=args.min_data_planes,
                     min_spine_replicas=args.min_spine_replicas)


def build_legacy_target(args: argparse.Namespace) -> TrafficTarget:
    """The HTTP front between a foreign legacy endpoint and the spine's HTTP API, in this process;
    gates on what the front measures, parity on its shadow comparisons."""
    from migration.legacy_endpoint import endpoint
    from migration.metrics.scrape import ScrapeSource
    from migration.traffic.http_front import HttpFront
    from migration.traffic.http_mirror import MirrorSettings
    from migration.traffic.legacy_target import LegacyTarget
    from runtime.config.http import HttpConfig
    from runtime.http.server import HttpServer
    from services.common.prometheus_http import PrometheusHTTPServer

    missing = [flag for flag, value in (("--legacy-http", args.legacy_http), ("--spine-http", args.spine_http),
                                        ("--front-listen", args.front_listen)) if not value]
    if missing:
        raise ConfigError(f"--target legacy-http needs {', '.join(missing)}")
    if not 0.0 <= args.shadow_share <= 1.0:
        raise ConfigError(f"--shadow-share: must be between 0 and 1, got {args.shadow_share:g}")
    try:
        legacy = endpoint(args.legacy_http, args.legacy_api_key_header)
        spine = endpoint(args.spine_http)
    except ValueError as error:
        raise ConfigError(str(error).replace("legacy http", "--legacy-http/--spine-http")) from None
    secret = read_secret_file(args.internal_secret_file, "--internal-secret-file") if args.internal_secret_file \
        else None
    mirror = MirrorSettings(share=args.shadow_share) if args.shadow_share > 0 else None
    front = HttpFront(legacy, spine.http, mirror=mirror, internal_key=secret.encode() if secret else None,
                      http=HttpConfig(), timeout_s=args.front_timeout_s)
    try:
        server = HttpServer(front, front.http, args.front_listen, tls=tls_of(args),
                            allow_external=args.allow_external).start()
    except (OSError, ValueError) as error:
        raise ConfigError(f"--front-listen: {error}") from None
    log.info("HTTP front on http://%s: %s <-> spine %s", server.address, legacy.describe(), spine.http)
    parity = None
    if front.mirror is not None:
        metrics = PrometheusHTTPServer(front.mirror.counters.registry)
        metrics.start()
        log.info("the front's shadow comparisons on http://%s/metrics", metrics.address)
        parity = ScrapeSource({"front": [f"http://{metrics.address}/metrics"]}, interval_s=args.scrape_interval_s)
    return LegacyTarget(front, parity)


def build_metrics_source(args: argparse.Namespace) -> MetricsSource:
    """PromQL against --prometheus-url, else a direct scrape of every --*-metrics URL."""
    scrape = args.layered_metrics or args.spine_metrics
    try:
        if args.prometheus_url:
            if scrape:
                raise ConfigError("--prometheus-url and --layered-metrics/--spine-metrics exclude each other: "
                                  "the gates read one metrics source")
            from migration.metrics.promql import PrometheusSource

            prometheus = PrometheusSource(
                args.prometheus_url, {"layered": args.layered_selector, "spine": args.spine_selector})
            log.info("gates on PromQL from %s (layered {%s}, spine {%s})", prometheus.url,
                     prometheus.selectors["layered"], prometheus.selectors["spine"])
            return prometheus
        if args.layered_selector or args.spine_selector:
            raise ConfigError("--layered-selector/--spine-selector pick series in Prometheus: "
                              "they need --prometheus-url")
        if not (args.layered_metrics and args.spine_metrics):
            raise ConfigError("--target xds needs --prometheus-url, or --layered-metrics and --spine-metrics "
                              "(each repeatable: every /metrics endpoint of the side)")
        if not args.scrape_interval_s > 0:
            raise ConfigError(f"--scrape-interval-s: must be greater than 0, got {args.scrape_interval_s:g}")
        from migration.metrics.scrape import ScrapeSource

        return ScrapeSource({"layered": args.layered_metrics, "spine": args.spine_metrics},
                            interval_s=args.scrape_interval_s)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def tls_of(args: argparse.Namespace) -> TlsConfig | None:
    """--tls-*: the controller's certificate for both listeners and the gateways' health, or None."""
    given = {key: getattr(args, f"tls_{key}") for key in ("cert_file", "key_file", "client_ca_file", "ca_file")}
    if not any(given.values()):
        return None
    if not (given["cert_file"] and given["key_file"]):
        raise ConfigError("--tls-cert-file and --tls-key-file: TLS needs both (--tls-client-ca-file and "
                          "--tls-ca-file are optional)")
    return TlsConfig(**{key: value for key, value in given.items() if value})


def webhooks_of(args: argparse.Namespace) -> tuple[WebhookConfig, ...]:
    """--webhook-url (each) with the secret from --webhook-secret-file."""
    if not args.webhook_url:
        if args.webhook_secret_file:
            raise ConfigError("--webhook-secret-file: no --webhook-url to sign for")
        return ()
    if not args.webhook_secret_file:
        raise ConfigError("--webhook-url needs --webhook-secret-file: every notification is signed")
    secret = read_secret_file(args.webhook_secret_file, "--webhook-secret-file")
    try:
        return tuple(WebhookConfig(url, secret) for url in args.webhook_url)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def store_of(args: argparse.Namespace) -> tuple[str, LeaseSettings | None]:
    """--db or --db-dsn-file, and the lease settings where replicas elect a leader."""
    if bool(args.db) == bool(args.db_dsn_file):
        raise ConfigError("give the state store once: --db (a sqlite path or postgresql://…) or --db-dsn-file")
    location = read_secret_file(args.db_dsn_file, "--db-dsn-file") if args.db_dsn_file else args.db
    if args.db_dsn_file and not is_postgres(location):
        raise ConfigError("--db-dsn-file: expected a PostgreSQL DSN (postgresql://USER:PASSWORD@HOST:PORT/DB)")
    if args.db and is_postgres(location) and carries_password(location):
        raise ConfigError("--db: a password on the command line is visible to every user of this machine (ps); "
                          "put the DSN in --db-dsn-file (mode 600), or the password in PGPASSWORD/PGPASSFILE")
    if not (args.leader_elect or is_postgres(location)):
        return location, None
    lease = LeaseSettings(args.lease_duration_s, args.lease_renew_deadline_s, args.lease_retry_period_s)
    log.info("state in %s; leader election: lease %gs, renew deadline %gs, retry %gs", redacted(location),
             lease.duration_s, lease.renew_deadline_s, lease.retry_period_s)
    return location, lease


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m migration.runner", description=__doc__.splitlines()[0])
    parser.add_argument("--db", help="where the rollout state lives: a sqlite file (one controller, or several on one "
                                     "machine), or a PostgreSQL DSN postgresql://USER@HOST:PORT/DB (several replicas; "
                                     "its password from PGPASSWORD/PGPASSFILE or --db-dsn-file, never the command line)")
    parser.add_argument("--db-dsn-file", help="file (mode 600) holding the PostgreSQL DSN, password included")
    parser.add_argument("--leader-elect", action="store_true",
                        help="elect a leader among the replicas sharing --db (always on with PostgreSQL): only the "
                             "leader ticks, takes writes and pushes stages; every write is fenced by its lease epoch")
    parser.add_argument("--lease-duration-s", type=float, default=15.0,
                        help="how long a lease holds after its last renewal (another replica waits this long)")
    parser.add_argument("--lease-renew-deadline-s", type=float, default=10.0,
                        help="the leader stops leading when it could not renew for this long (< --lease-duration-s)")
    parser.add_argument("--lease-retry-period-s", type=float, default=2.0,
                        help="seconds between election rounds (renewals, or tries to take an expired lease)")
    parser.add_argument("--controller-id", help="this replica's name in the lease (default HOST:PID; a pod's name)")
    parser.add_argument("--advertise", metavar="ADDRESS",
                        help="where other replicas tell operators to send writes when this one leads (default --listen)")
    parser.add_argument("--listen", required=True, help="unix:PATH or a loopback HOST:PORT")
    parser.add_argument("--admin-token-file", help=f"file holding the admin token (else ${'SPINE_ADMIN_TOKEN'})")
    parser.add_argument("--target", choices=["recording", "xds", "legacy-http"], required=True,
                        help="the data path to drive (xds: Envoy/proxyless data planes over ADS, gates on each "
                             "side's metrics; legacy-http: an HTTP front in this process between a foreign "
                             "OpenAI/Anthropic-compatible endpoint and the spine's HTTP API, gates on what it "
                             "measures; recording: a test double with healthy stats, for trials only)")
    parser.add_argument("--legacy-http", metavar="URL",
                        help="with --target legacy-http: the legacy endpoint's root, e.g. http://127.0.0.1:4000")
    parser.add_argument("--legacy-api-key-header", default="authorization",
                        help="with --target legacy-http: the header clients send their key in (forwarded unchanged)")
    parser.add_argument("--spine-http", metavar="URL", help="with --target legacy-http: the spine's HTTP API root")
    parser.add_argument("--front-listen", metavar="HOST:PORT",
                        help="with --target legacy-http: where the front serves clients (loopback unless "
                             "--allow-external; over TLS with the --tls-* files)")
    parser.add_argument("--shadow-share", type=float, default=0.0,
                        help="with --target legacy-http: the share of answered requests copied to the other side "
                             "and compared (parity gates need > 0; a copy to the legacy endpoint is a real request)")
    parser.add_argument("--internal-secret-file",
                        help="with --target legacy-http: the spine's internal secret (mode 600): shadow copies to "
                             "the spine carry its signed mark, so they are dry-run there")
    parser.add_argument("--front-timeout-s", type=float, default=300.0,
                        help="with --target legacy-http: a forwarded request's whole budget")
    parser.add_argument("--min-data-planes", type=int, default=1,
                        help="with --target xds: a stage counts as applied only once at least this many data "
                             "planes have ACKed it (default 1: an ACK means someone listened)")
    parser.add_argument("--min-spine-replicas", type=int, default=1,
                        help="with --target xds: a stage counts as applied only once at least this many spine "
                             "replicas follow the controller (spine up --follow-controller) and every follower has "
                             "applied the stage's placements and rate-limit shares (default 1; 0 where the spine's "
                             "placements are its own config)")
    parser.add_argument("--allow-external", action="store_true",
                        help="allow non-loopback listen addresses (in a cluster; they need TLS, and the admin token "
                             "guards the API)")
    parser.add_argument("--tls-cert-file", help="PEM certificate of both listeners (MigrationControl, xDS); with "
                                                "--tls-key-file they speak TLS")
    parser.add_argument("--tls-key-file", help="its private key (PEM)")
    parser.add_argument("--tls-client-ca-file",
                        help="require client certificates signed by this CA (mTLS: operators, Envoy, followers)")
    parser.add_argument("--tls-ca-file", help="the CA the gateways' certificates are verified against "
                                              "(default: --tls-client-ca-file)")
    parser.add_argument("--probe-listen", metavar="HOST:PORT",
                        help="also answer grpc.health.v1 alone, in plaintext, here (Kubernetes' grpc probes cannot "
                             "speak TLS)")
    parser.add_argument("--xds-listen", help="with --target xds: where ADS listens, HOST:PORT")
    parser.add_argument("--layered", action="append", default=[], help="with --target xds: a layered gateway HOST:PORT")
    parser.add_argument("--spine", action="append", default=[], help="with --target xds: a spine HOST:PORT")
    parser.add_argument("--prometheus-url",
                        help="with --target xds: gates on PromQL from this Prometheus server (http://HOST:PORT)")
    parser.add_argument("--layered-selector",
                        help='with --prometheus-url: label matchers picking the layered series (default layout="layered")')
    parser.add_argument("--spine-selector",
                        help='with --prometheus-url: label matchers picking the spine series (default layout!="layered")')
    parser.add_argument("--layered-metrics", action="append", default=[],
                        help="with --target xds, without Prometheus: a layered /metrics URL to scrape (repeat for "
                             "every endpoint of the side)")
    parser.add_argument("--spine-metrics", action="append", default=[],
                        help="with --target xds, without Prometheus: a spine /metrics URL to scrape (repeatable)")
    parser.add_argument("--scrape-interval-s", type=float, default=0.5,
                        help="with --layered-metrics/--spine-metrics: seconds between scrapes")
    parser.add_argument("--recording-file", help="with --target recording: append every apply to this JSON-lines file")
    parser.add_argument("--tick-s", type=float, default=0.1, help="seconds between reconcile ticks")
    parser.add_argument("--dashboard-listen", metavar="HOST:PORT",
                        help="serve the operator's dashboard (and the controller's /metrics) here; loopback unless "
                             "--allow-external, and with the --tls-* files when given")
    parser.add_argument("--dashboard-view-without-token", action="store_true",
                        help="let anyone who reaches the dashboard read it (its buttons still need the admin token)")
    parser.add_argument("--webhook-url", action="append", default=[],
                        help="POST every transition here as signed JSON (repeatable; needs --webhook-secret-file)")
    parser.add_argument("--webhook-secret-file", help="file (mode 600) holding the webhooks' HMAC secret")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    if not follow_parent():
        return 1  # started by `spawn`, whose process died before we could ask to die with it
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    quiet_http_clients()  # not one INFO line per proxied request: the controller's own lines stay readable
    args = parse_args(argv)
    try:
        token = read_admin_token(args.admin_token_file)
        tls = tls_of(args)
        check_listen(args.listen, args.allow_external, tls)  # before the target starts anything
        for flag, address in (("--listen", args.listen), ("--dashboard-listen", args.dashboard_listen),
                              ("--xds-listen", args.xds_listen), ("--front-listen", args.front_listen),
                              ("--probe-listen", args.probe_listen)):
            if address:  # each free now, or one line and exit 2 before anything starts
                check_free(address, flag)
        if tls is not None:
            from runtime.core_log import log_tls_refusals
            from runtime.tls import load_certificates, reload_on_sighup

            load_certificates(tls, where="--tls")
            log_tls_refusals()
            reload_on_sighup()
        webhooks = webhooks_of(args)
        store, lease = store_of(args)
        target = build_target(args)
        process = ControllerProcess(store, args.listen, token, target, tick_s=args.tick_s,
                                    allow_external=args.allow_external, tls=tls, probe_listen=args.probe_listen,
                                    dashboard_listen=args.dashboard_listen,
                                    view_without_token=args.dashboard_view_without_token, webhooks=webhooks,
                                    lease=lease, identity=args.controller_id, advertise=args.advertise)
        serve_stable = getattr(target, "serve_stable", None)
        # After the controller re-applied whatever it recorded; a replica that may not lead
        # serves nothing yet (it does this once it leads).
        if serve_stable is not None and lease is None:
            serve_stable()
        process.start()
        if process.dashboard_url:
            log.info("dashboard: %s (its buttons take the admin token; `spine migrate status` prints a link "
                     "that carries it)", process.dashboard_url)
            if sys.stdout.isatty():  # the operator's terminal, never a log: the link carries the token
                print(f"dashboard: {process.dashboard_link}", flush=True)
    except (ConfigError, AddressError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except StoreUnavailable as exc:
        print(f"error: the state store did not answer: {exc}", file=sys.stderr)
        return 3
    Termination().wait()  # a handler that calls Event.set() can deadlock the main thread
    log.info("stopping migration controller")
    process.stop()
    close = getattr(target, "close", None)
    if close is not None:
        close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
