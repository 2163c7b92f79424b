"""The rehearsal's processes (`python -m spine.tools.rehearsal.run`): one config per role, the
command line each runs (what `deploy/k8s/` runs), started in order on loopback and unix sockets.

Every rate limiter of the rehearsal (the layered one and each spine replica's) leases from one
shared store (`ratelimit.store.redis`): a real `redis-server` on loopback
(`spine.tools.local_redis`), started first and stopped last."""

from __future__ import annotations

import json
import secrets
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml

from runtime.config.file import dev_api_key, load_config, merge
from runtime.processes.launch import spine_up_argv
from runtime.server import free_ports, wait_serving
from services.registry import COMPONENTS, MIDDLEWARES
from spine.tools.local_postgres import LocalPostgres, PostgresError
from spine.tools.local_prometheus import LocalPrometheus
from spine.tools.local_redis import LocalRedis
from spine.tools.rehearsal.containers import Containers
from spine.tools.rehearsal.processes import (
    Child,
    Processes,
    RehearsalError,
    base_env,
    command_line,
)
from spine.tools.rehearsal.report import SPINES
from wire.v1 import migration_pb2_grpc

ROOT = Path(__file__).resolve().parents[3]
REHEARSAL_PLAN = ROOT / "deploy" / "plans" / "rehearsal.yaml"
SECRET_ENV = "SPINE_INTERNAL_SECRET"
STORE_PREFIX = "rehearsal:ratelimit:"  # every limiter's keys in the shared store


@dataclass
class Options:
    plan_text: str = field(default_factory=REHEARSAL_PLAN.read_text)
    config: Mapping[str, Any] | None = None  # laid under every process's config (e.g. a model)
    clients: int = 2
    rate: float = 8.0  # requests per second, per client
    # Of its answers each spine mirrors to the layered side: all of them at a rehearsal's few
    # requests per second, so every window of the parity gate has comparisons to judge.
    shadow_share: float = 1.0
    scrape_interval_s: float = 0.5
    parity_run: bool = True
    workdir: Path | None = None  # default: a fresh directory under /tmp, removed afterwards
    keep: bool = False
    start_timeout_s: float = 150.0  # for bringing everything up, and again for restarting the replicas
    run_timeout_s: float = 150.0  # for each walk of the plan
    # `process`: every process a child of this one; `podman`: each a container of `image`
    # (spine.tools.rehearsal.containers), the layered components one container each.
    runtime: str = "process"
    image: str | None = None
    # Where the controller keeps its state: `sqlite` (a file in the workdir) or `postgres` (a
    # throwaway PostgreSQL on loopback, spine.tools.local_postgres; the controller elects
    # itself leader under the lease, as one of several replicas would).
    state_store: str = "sqlite"
    echo: Callable[[str], None] = field(default=lambda line: print(line, flush=True))


class Launcher:
    """Every process of the rehearsal: their configs, command lines and addresses, started in order."""

    def __init__(self, options: Options, workdir: Path) -> None:
        self.options = options
        self.work = workdir
        self._began = time.monotonic()
        self.containers: Containers | None = None
        if options.runtime == "podman":
            if not options.image:
                raise RehearsalError("RUNTIME=podman needs an image (make image; --image)")
            self.containers = Containers(options.image, workdir)
        self.processes = Processes(workdir / "logs", env={SECRET_ENV: secrets.token_hex(24)} | base_env()
                                   | (self.containers.env if self.containers else {}))
        (self.ads_port, self.layered_port, self.layered_metrics_port, self.limiter_metrics_port,
         *spine_ports) = free_ports(4 + 2 * len(SPINES))
        self.spine_ports = dict(zip(SPINES, spine_ports[:len(SPINES)], strict=True))
        self.spine_metrics_ports = dict(zip(SPINES, spine_ports[len(SPINES):], strict=True))
        self.ads = f"127.0.0.1:{self.ads_port}"
        self.layered = f"127.0.0.1:{self.layered_port}"
        self.controller_address = f"unix:{workdir / 'controller.sock'}"
        self.admin_token = secrets.token_urlsafe(24)
        self.prometheus: LocalPrometheus | None = None
        # The rate limiters' shared lease store: its port is known now, so every config can name it.
        self.redis = LocalRedis(workdir / "redis")
        self.postgres: LocalPostgres | None = None  # with state_store "postgres"
        self.controller: Child | None = None
        self.spines: dict[str, Child] = {}
        self.clients: list[Child] = []
        self.base = load_config(overrides=options.config or {})
        self.api_key = dev_api_key(self.base) or ""
        self._channel: grpc.Channel | None = None
        self._stub: migration_pb2_grpc.MigrationControlStub | None = None
        self._phase = ("", 0.0, time.monotonic())  # (what, its budget in s, when it ends)

    def begin_phase(self, what: str, budget_s: float) -> None:
        """Every wait until the next phase shares one deadline: `budget_s` from now."""
        self._phase = (what, budget_s, time.monotonic() + budget_s)

    def left(self) -> float:
        """Seconds left in the current phase (a little at least, so a last check still runs)."""
        return max(0.1, self._phase[2] - time.monotonic())

    def echo(self, text: str) -> None:
        """Lines of the rehearsal's log, each with the seconds since it began (a leading newline:
        a blank line first)."""
        if text.startswith("\n"):
            self.options.echo("")
        for part in text.lstrip("\n").splitlines() or [""]:
            self.options.echo(f"[{time.monotonic() - self._began:6.1f}s] {part}")

    # -- configs -------------------------------------------------------------------------------

    def write_configs(self) -> None:
        """One config per role; each names only what differs from the default."""
        layered_dir = self.work / "layered"
        internal = {"secret_env": SECRET_ENV}
        common = merge(dict(self.options.config or {}), {"ratelimit": {"store": {
            "redis": {"address": self.redis.address, "key_prefix": STORE_PREFIX}}}})
        self.ratelimit_address = f"unix:{self.work / 'layered-ratelimit.sock'}"
        layered = merge(common, {"internal": internal,
                                 "metrics": {"http_listen": f"127.0.0.1:{self.layered_metrics_port}"},
                                 # the following rate limiter's own /metrics: its store's families
                                 "ratelimit": {"store": {"metrics_listen": self.limiter_metrics}},
                                 # the layered stack's rate limiter is the one that follows the controller
                                 "remote_addresses": {"ratelimit": self.ratelimit_address}
                                 | (self.layered_components(layered_dir) if self.containers else {})})
        (self.work / "layered.yaml").write_text(yaml.safe_dump(layered))
        remote = {name: f"unix:{layered_dir / (name + '.sock')}" for name in MIDDLEWARES} | {
            "ratelimit": self.ratelimit_address}
        for name in SPINES:
            spine = merge(common, {"internal": internal, "remote_addresses": remote,
                                   "metrics": {"http_listen": f"127.0.0.1:{self.spine_metrics_ports[name]}"},
                                   "shadow": {"share": self.options.shadow_share, "layered_address": self.layered}})
            (self.work / f"{name}.yaml").write_text(yaml.safe_dump(spine))

    # -- starting ------------------------------------------------------------------------------

    def layered_components(self, layered_dir: Path) -> dict[str, str]:
        """The layered components other than the rate limiter, each at its socket in `layered_dir`
        (where `spine up --layout layered` would put its children's)."""
        return {name: f"unix:{layered_dir / (name + '.sock')}" for name in COMPONENTS if name != "ratelimit"}

    def start(self, name: str, argv: list[str], **kwargs: Any) -> Child:
        """Start `argv` as `name`: a child process, or with RUNTIME=podman a container of the image."""
        if self.containers is None:
            self.echo(f"  $ {command_line(argv, self.work)}")
            return self.processes.start(name, argv, **kwargs)
        shown = ["python", *argv[1:]]  # the image's interpreter, as the container runs it
        self.echo(f"  [container {self.containers.podman.name(name)}] $ {command_line(shown, self.work)}")
        wrapped = self.containers.wrap(name, argv, env_keys=[SECRET_ENV, *(kwargs.get("env") or {})],
                                       stdin=bool(kwargs.get("pipes")))
        return self.processes.start(name, wrapped, **kwargs)

    @property
    def limiter_metrics(self) -> str:
        """The layered rate limiter's own /metrics (it runs apart from the layered stack)."""
        return f"127.0.0.1:{self.limiter_metrics_port}"

    def store_metrics(self) -> dict[str, str]:
        """Each rate limiter's /metrics with its store families, by process name."""
        return {"layered-ratelimit": self.limiter_metrics} | {
            child.name: f"127.0.0.1:{self.spine_metrics_ports[name]}" for name, child in self.spines.items()}

    def start_redis(self) -> None:
        """The shared lease store, first: every rate limiter leases from it from its start."""
        try:
            self.redis.start()
        except RuntimeError as error:  # not installed, or it would not start: one line, as for the others
            raise RehearsalError(str(error)) from None
        assert self.redis.process is not None
        self.echo(f"  $ redis-server --bind 127.0.0.1 --port {self.redis.port} --save '' (pid {self.redis.process.pid}): "
                  f"the rate limiters' shared store, ratelimit.store.redis.address {self.redis.address}")

    def start_postgres(self) -> None:
        """The controller's state store, where the rehearsal walks on PostgreSQL."""
        if self.options.state_store != "postgres":
            return
        try:
            self.postgres = LocalPostgres()
            self.postgres.start()
        except (PostgresError, OSError) as error:
            raise RehearsalError(f"PostgreSQL: {error}") from None
        assert self.postgres.process is not None
        self.echo(f"  $ postgres -D {self.postgres.data} -c listen_addresses=127.0.0.1 -p {self.postgres.port} "
                  f"(pid {self.postgres.process.pid}): the controller's state store, {self.postgres.describe()}")

    def store_location(self) -> list[str]:
        """The controller's --db (sqlite) or --db-dsn-file (PostgreSQL: the password stays in a file)."""
        if self.postgres is None:
            return ["--db", str(self.work / "rollout.db")]
        dsn_file = self.work / "state-dsn"
        dsn_file.write_text(self.postgres.dsn + "\n")
        dsn_file.chmod(0o600)
        if self.containers is not None:
            self.containers.hand_over(dsn_file)
        return ["--db-dsn-file", str(dsn_file)]

    def stop_postgres(self) -> None:
        if self.postgres is not None and self.postgres.process is not None:
            pid = self.postgres.process.pid
            self.postgres.remove()
            self.processes.stopped.append(("postgres", pid, 0))

    def start_prometheus(self) -> None:
        jobs = {"layered": [f"127.0.0.1:{self.layered_metrics_port}"],
                "spine": [f"127.0.0.1:{port}" for port in self.spine_metrics_ports.values()],
                "ratelimit": [self.limiter_metrics]}
        # assigned before it starts, so that an interruption while it starts still stops it
        self.prometheus = LocalPrometheus(self.work / "prometheus", jobs, self.options.scrape_interval_s)
        self.prometheus.start(min(30.0, self.left()))
        assert self.prometheus.process is not None
        self.echo(f"  prometheus on {self.prometheus.url} (pid {self.prometheus.process.pid}), scraping every "
                  f"{self.options.scrape_interval_s:g}s: job layered {jobs['layered']}, job spine {jobs['spine']}, "
                  f"job ratelimit {jobs['ratelimit']}")

    def start_controller(self) -> None:
        token_file = self.work / "admin-token"
        token_file.write_text(self.admin_token)
        token_file.chmod(0o600)
        if self.containers is not None:  # read by the controller's container, as the image's user
            self.containers.hand_over(token_file)
        assert self.prometheus is not None
        argv = [sys.executable, "-m", "migration.runner", *self.store_location(),
                "--listen", self.controller_address, "--admin-token-file", str(token_file), "--target", "xds",
                "--xds-listen", self.ads, "--layered", self.layered,
                *(arg for port in self.spine_ports.values() for arg in ("--spine", f"127.0.0.1:{port}")),
                "--prometheus-url", self.prometheus.url,
                "--min-spine-replicas", str(len(SPINES)), "--min-data-planes", str(self.options.clients)]
        self.controller = self.start("controller", argv)
        if not wait_serving(self.controller_address, timeout=self.left()):
            raise self.controller.died() if not self.controller.alive() else RehearsalError(
                "the controller did not serve in time")
        self._channel = grpc.insecure_channel(self.controller_address)
        self._stub = migration_pb2_grpc.MigrationControlStub(self._channel)

    def start_layered(self) -> tuple[Child, Child]:
        config = str(self.work / "layered.yaml")
        limiter = self.start("layered-ratelimit", [
            sys.executable, "-m", "runtime.process", "ratelimit", "--listen", self.ratelimit_address,
            "--config", config, "--run-dir", str(self.work / "layered-ratelimit"),
            "--follow-controller", self.ads, "--node-id", "layered-ratelimit-1"])
        if self.containers is not None:  # a container per component, as deploy/k8s/layered runs them
            layered_dir = self.work / "layered"
            layered_dir.mkdir(exist_ok=True)
            self.containers.hand_over(layered_dir)
            components = [self.start(f"layered-{name}", [
                sys.executable, "-m", "runtime.process", name, "--listen", address, "--config", config,
                "--run-dir", str(layered_dir)]) for name, address in self.layered_components(layered_dir).items()]
            for child in components:
                child.ready_line(self.left(), startswith=child.name.removeprefix("layered-") + " serving")
        stack = self.start("layered", spine_up_argv(config, "layered", listen=self.layered, http_listen="127.0.0.1:0",
                                                    run_dir=self.work / "layered"))
        return limiter, stack

    def start_spine(self, name: str, fault: str | None = None, generation: int = 1) -> Child:
        argv = spine_up_argv(self.work / f"{name}.yaml", "collapsed", listen=f"127.0.0.1:{self.spine_ports[name]}",
                             http_listen="127.0.0.1:0", run_dir=self.work / f"{name}-{generation}",
                             extra=("--follow-controller", self.ads, "--node-id", name,
                                    *(("--inject-fault", fault) if fault else ())))
        self.spines[name] = self.start(f"{name}-{generation}", argv)
        return self.spines[name]

    def start_clients(self) -> None:
        for number in range(1, self.options.clients + 1):
            node = f"proxyless-client-{number}"
            bootstrap = {"xds_servers": [{"server_uri": self.ads, "channel_creds": [{"type": "insecure"}],
                                          "server_features": ["xds_v3"]}],
                         "node": {"id": node, "cluster": "rehearsal"}}
            argv = [sys.executable, "-m", "spine.tools.rehearsal.client", "--token", self.api_key,
                    "--rate", f"{self.options.rate:g}", "--prefix", node,
                    "--duration-s", f"{2 * (self.options.start_timeout_s + self.options.run_timeout_s):g}"]
            env = {"GRPC_XDS_BOOTSTRAP_CONFIG": json.dumps(bootstrap)}
            where = f"[container {self.containers.podman.name(node)}] " if self.containers else ""
            shown = ["python", *argv[1:]] if self.containers else argv
            self.echo(f"  {where}$ GRPC_XDS_BOOTSTRAP_CONFIG='{json.dumps(bootstrap)}' "
                      f"{command_line(shown, self.work).replace(self.api_key, '$KEY')}")
            if self.containers is not None:
                argv = self.containers.wrap(node, argv, env_keys=[SECRET_ENV, *env], stdin=True)
            self.clients.append(self.processes.start(node, argv, env=env, pipes=True))
