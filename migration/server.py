"""The controller served: the controller, its MigrationControl API, health and the tick loop.

`ControllerProcess` binds only to a unix socket or loopback (unless told otherwise; and
beyond loopback only with TLS: the admin token must not cross a network in plaintext),
serves the operator API behind the admin token, and ticks the controller every ~100 ms so a failing
gate's rollback reaches the data path well within a second. With a lease (`LeaseSettings`)
it is one of several replicas sharing one store (`migration.leadership`): only the leader
ticks and takes writes, the others follow its record and name it. `migration.runner` runs
one as a process; the local migration (`migration.traffic.cutover`) runs one in-process.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import stat
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from migration.admin_token import dashboard_link
from migration.controller import Controller
from migration.dashboard import DashboardServer
from migration.dashboard.metrics import ControllerCollector
from migration.leadership import LeaderElector, LeaseSettings, default_identity
from migration.lease import Fenced, LeadershipView
from migration.notify import WebhookConfig, WebhookNotifier
from migration.service import SERVICE_NAME, MigrationService
from migration.store_backends import StoreUnavailable
from migration.target import TrafficTarget
from runtime.config.sections import TlsConfig
from runtime.server import ProbeServer, start_probe_server
from runtime.tls import add_port
from services.common import Clock, ConfigError
from services.common.log_limit import RateLimitedLog
from wire.v1 import migration_pb2, migration_pb2_grpc

log = logging.getLogger("spine.migration")
# A store that is down fails every tick (ten a second): one line a second says so.
_store_down = RateLimitedLog(log, "state store failures")
# The health service name a replica answers SERVING for only while it leads.
LEADER_HEALTH = "spine.v1.MigrationLeader"


def check_listen(listen: str, allow_external: bool = False, tls: TlsConfig | None = None,
                 flag: str = "--listen") -> str:
    """`unix:PATH` or a loopback `host:port`; anything that could face a network is refused
    unless `allow_external` (a pod address in a cluster, where the admin token guards it),
    and even then unless the listener speaks TLS (`tls`): the admin token — and for xDS, the
    stages every data plane and follower obeys — would otherwise cross the network in
    plaintext."""
    if listen.startswith("unix:"):
        if not listen[len("unix:"):]:
            raise ConfigError("--listen: unix: needs a socket path, e.g. unix:/run/spine/migration.sock")
        return listen
    host, sep, port = listen.rpartition(":")
    host = host.strip("[]")
    if not sep or not port.isdigit():
        raise ConfigError(f"{flag}: expected unix:PATH or HOST:PORT, got {listen!r}")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if loopback:
        return listen
    if not allow_external:
        raise ConfigError(f"{flag}: the controller binds to loopback or a unix socket only, got {listen!r} "
                          "(--allow-external, with TLS, to listen beyond this machine)")
    if tls is None:
        raise ConfigError(f"{flag} {listen}: a controller listener beyond loopback needs TLS "
                          "(--tls-cert-file, --tls-key-file, and --tls-client-ca-file for mTLS): without it the "
                          "admin token and the stages would cross the network in plaintext")
    return listen


class ControllerProcess:
    """Controller + gRPC server + tick thread, started and stopped together."""

    def __init__(self, db_path: str, listen: str, admin_token: str, target: TrafficTarget, *,
                 tick_s: float = 0.1, clock: Clock = time.time, allow_external: bool = False,
                 tls: TlsConfig | None = None, probe_listen: str | None = None,
                 dashboard_listen: str | None = None, view_without_token: bool = False,
                 webhooks: tuple[WebhookConfig, ...] = (), lease: LeaseSettings | None = None,
                 identity: str | None = None, advertise: str | None = None) -> None:
        self.listen = check_listen(listen, allow_external, tls)
        if dashboard_listen is not None:
            check_listen(dashboard_listen, allow_external, tls, "--dashboard-listen")
            if dashboard_listen.startswith("unix:"):
                raise ConfigError("--dashboard-listen: a browser needs HOST:PORT, e.g. 127.0.0.1:8470")
        self.tls = tls
        self.probe_listen = probe_listen
        self.allow_external = allow_external
        self.probe: ProbeServer | None = None
        self._target = target
        self._admin_token = admin_token
        # With a lease, this is one of several replicas on one store: it re-applies the
        # recorded stage only once it leads (`_reconcile`), and only the leader ticks.
        self.controller = Controller.open(db_path, target, clock=clock, recover=lease is None)
        self.elector: LeaderElector | None = None
        self._led_epoch: int | None = None  # the epoch this replica re-applied the record under
        self._resync = False  # the store failed mid-tick: re-apply the record once it answers
        if lease is not None:
            self.elector = LeaderElector(self.controller.store, identity or default_identity(), advertise or self.listen,
                                         lease, on_lose=self.controller.wake_watchers)
            self.controller.report_leadership(self._leadership)
            self._target_hook("stand_by")  # pushes nothing (an xDS server: serves no one) until it leads
        # Every transition to each webhook, from a thread of its own (never in the controller's way).
        self.notifiers = [WebhookNotifier(config) for config in webhooks]
        for notifier in self.notifiers:
            self.controller.on_transition(notifier)
        self.dashboard: DashboardServer | None = None
        if dashboard_listen is not None:
            collector = ControllerCollector(self.controller, self.webhook_counts)
            self.dashboard = DashboardServer(self.controller, admin_token, target, dashboard_listen, tls=tls,
                                             view_without_token=view_without_token, collectors=(collector,))
        self.service = MigrationService(self.controller, admin_token,
                                        dashboard_url=self.dashboard.url if self.dashboard is not None else "",
                                        leader_check=self._check_write if self.elector else None)
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
        try:
            self.port = add_port(self.server, self.listen, self.tls, "--tls")
        except RuntimeError:  # grpc's "Failed to bind to address"
            self.port = 0
        if not self.listen.startswith("unix:") and self.port == 0:
            raise ConfigError(f"--listen: could not bind {self.listen}")
        if self.probe_listen is not None:  # health alone, in plaintext, for Kubernetes' grpc probes
            self.probe = start_probe_server(self.health, self.probe_listen, self.allow_external)
        self.server.start()
        for service in ("", SERVICE_NAME):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        if self.elector is not None:  # SERVING once it leads: a readiness probe that routes to the leader
            self.health.set(LEADER_HEALTH, health_pb2.HealthCheckResponse.NOT_SERVING)
            self.elector.start()
        self._ticker.start()
        if self.dashboard is not None:
            self.dashboard.start()
        log.info("migration controller listening on %s", self.listen)

    @property
    def dashboard_url(self) -> str | None:
        return self.dashboard.url if self.dashboard is not None else None

    @property
    def dashboard_link(self) -> str | None:
        """The dashboard's URL with the admin token in its fragment (`dashboard_link`): for the
        operator's screen only, never a log."""
        return dashboard_link(self.dashboard.url, self._admin_token) if self.dashboard is not None else None

    def webhook_counts(self) -> dict[str, dict[str, int]]:
        """Deliveries per webhook endpoint (scheme://host:port) and result."""
        counts: dict[str, dict[str, int]] = {}
        for notifier in self.notifiers:
            mine = counts.setdefault(notifier.config.endpoint, {})
            for result, count in notifier.counts.items():
                mine[result] = mine.get(result, 0) + count
        return counts

    def stop(self, grace: float = 1.0) -> None:
        self._stop.set()
        if self.dashboard is not None:
            self.dashboard.stop()
        self.health.enter_graceful_shutdown()
        self.service.close()
        self.server.stop(grace).wait()
        if self.probe is not None:
            self.probe.stop()
        if self._ticker.is_alive():
            self._ticker.join()
        if self.elector is not None:
            self.elector.stop()  # releases the lease: another replica takes over at once
        for notifier in self.notifiers:
            notifier.close()
        self.controller.close()
        _remove_stale_socket(self.listen)

    def _tick_loop(self) -> None:
        while not self._stop.wait(self._tick_s):
            try:
                self._reconcile()
            except Fenced:  # the store logged and counted it: this replica no longer leads
                if self.elector is not None:
                    self.elector.step_down()
            except StoreUnavailable as error:
                # What was pushed may not be what was recorded: once the store answers again,
                # start over from the record (`take_lead` re-applies it).
                _store_down("tick", "state store unavailable (%s); ticking resumes when it answers", error)
                self._resync = True
            except Exception:  # a flaky data path must not stop the loop; the next tick retries
                log.exception("migration tick failed; retrying")

    def _reconcile(self) -> None:
        """One tick: the leader (or the only controller) reconciles; a replica that does not
        lead only reads the leader's latest record, so its status answers stay current."""
        elector = self.elector
        if elector is None:
            self.controller.tick()
            return
        epoch = elector.epoch
        if epoch is None or not elector.leading:
            if self._led_epoch is not None:
                self.health.set(LEADER_HEALTH, health_pb2.HealthCheckResponse.NOT_SERVING)
                self._target_hook("stand_by")
            self._led_epoch = None
            self.controller.refresh()
            return
        if self._led_epoch != epoch:
            self._target_hook("lead")
            self.controller.take_lead(f"{elector.identity} took over as leader (lease epoch {epoch})",
                                      fence=(elector.identity, epoch))
            self._target_hook("serve_stable")  # nothing recorded to re-apply: the stable split
            self._led_epoch, self._resync = epoch, False
            self.health.set(LEADER_HEALTH, health_pb2.HealthCheckResponse.SERVING)
        elif self._resync:
            self.controller.take_lead(f"the state store answers again ({elector.identity}, lease epoch {epoch})")
            self._resync = False
        self.controller.tick()

    def _target_hook(self, name: str) -> None:
        """The target's optional `stand_by` / `lead` / `serve_stable` (an xDS target has them;
        the built-in front and a recording target need none)."""
        hook = getattr(self._target, name, None)
        if hook is not None:
            hook()

    def _acting(self) -> bool:
        """Leading, and taken over: the record re-applied under this epoch (until then a
        write would act on a status the previous leader may since have changed)."""
        elector = self.elector
        return elector is not None and elector.leading and self._led_epoch == elector.epoch

    def _check_write(self) -> None:
        if not self._acting():
            assert self.elector is not None
            self.elector.refuse_write()

    def _leadership(self) -> LeadershipView:
        elector = self.elector
        assert elector is not None
        leader = elector.leader()
        return LeadershipView(leader.holder if leader else "", leader.address if leader else "",
                              leader.epoch if leader else 0, elector.identity, self._acting(),
                              self.controller.store.fenced_writes)


def _remove_stale_socket(listen: str) -> None:
    if not listen.startswith("unix:"):
        return
    path = listen[len("unix:"):]
    try:
        if stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass
