"""Rehearse the production path on one machine: `python -m spine.tools.rehearsal.run` (`make rehearse`).

Everything a cluster runs, as separate processes on loopback and unix sockets:

- the layered stack (`spine up --layout layered`: the gateway and a process per component),
  whose rate limiter runs on its own and follows the controller
  (`python -m runtime.process ratelimit --follow-controller`);
- two spine replicas (`spine up --layout collapsed --follow-controller ADS --node-id spine-a|b`),
  each mirroring a share of its own answers to the layered gateway (`shadow:
  {share, layered_address}`, the internal secret shared through the environment);
- one Redis (`spine.tools.local_redis`) every rate limiter leases from (`ratelimit.store`),
  started first and stopped last; the report shows what it holds and each limiter's view of
  it after bring-up and after each walk (`spine.tools.rehearsal.store`);
- a real Prometheus server scraping every /metrics endpoint, one job per side (and one for the
  layered rate limiter's own);
- the migration controller (`python -m migration.runner --target xds --prometheus-url ...
  --min-spine-replicas 2 --min-data-planes N`): stages over ADS, gates on PromQL;
- N proxyless gRPC clients (`spine.tools.rehearsal.client`: `xds:///spine-gateway`, a
  bootstrap naming the controller's ADS) sending a bounded rate of requests.

It then walks a plan (`deploy/plans/rehearsal.yaml`) to 100% and prints each stage as it
happens: weights, each follower's placements and share as ACKed, each window's gate
verdicts, and which layout answered the clients. Then it aborts back to 100% layered,
restarts both spine replicas with the parity fault (`spine up --inject-fault wrong-answers`:
greedy requests sampled, every call succeeds) and walks the plan again: the parity gate
rolls it back. Every process is stopped by its PID at the end, on failure and on Ctrl-C;
the whole run is bounded in time.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from migration.plan import load_plan
from migration.state_store import Store
from runtime.config.file import load_config
from runtime.processes.signals import sigterm_as_interrupt, uninterrupted
from spine.tools.local_prometheus import PrometheusError
from spine.tools.rehearsal.launch import REHEARSAL_PLAN, STORE_PREFIX, Launcher, Options
from spine.tools.rehearsal.processes import Child, RehearsalError
from spine.tools.rehearsal.report import (
    SPINES,
    Report,
    RunRecord,
    StageRecord,
    counts_text,
    data_planes,
    gate_text,
    new_windows,
    rollback_reason,
    summary,
)
from spine.tools.rehearsal.store import look
from wire.v1 import migration_pb2

FINISHED = ("promoted", "rolled_back", "aborted")
RECONNECT_GRACE_S = 1.5  # the clients' reconnect backoff cap (1 s), and a margin


class Rehearsal(Launcher):
    """The production path, walked: the plan to 100%, then (optionally) the parity fault rolled back."""

    def __init__(self, options: Options, workdir: Path) -> None:
        super().__init__(options, workdir)
        self.report = Report()

    # -- the controller's view -----------------------------------------------------------------

    def status(self) -> migration_pb2.RolloutStatus:
        assert self._stub is not None
        status: migration_pb2.RolloutStatus = self._stub.Status(migration_pb2.StatusRequest(audit_rows=5),
                                                                metadata=self._md(), timeout=10)
        return status

    def _md(self) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {self.admin_token}")]

    def client_counts(self) -> tuple[Counter[str], Counter[str], list[str]]:
        codes: Counter[str] = Counter()
        layouts: Counter[str] = Counter()
        errors: list[str] = []
        for client in self.clients:
            counts = client.ask("counts")
            codes.update(counts["codes"])
            layouts.update(counts["layouts"])
            errors.extend(counts["errors"])
        return codes, layouts, errors

    def wait_for(self, what: str, check: Callable[[], Any]) -> Any:
        """`check()`'s first true value, polled until the current phase's deadline."""
        phase, budget_s, deadline = self._phase
        while True:
            value = check()
            if value:
                return value
            for child in self.processes.children:
                if not child.alive():
                    raise child.died()
            if time.monotonic() > deadline:
                raise RehearsalError(f"{phase}: timed out waiting for {what} (the phase's {budget_s:g}s are spent)")
            time.sleep(0.2)

    # -- the rehearsal -------------------------------------------------------------------------

    def bring_up(self) -> None:
        began = time.monotonic()
        self.begin_phase("bringing everything up", self.options.start_timeout_s)
        self.echo(f"starting, everything on loopback and unix sockets under {self.work} ($WORK):")
        self.start_redis()
        self.write_configs()
        self.start_prometheus()
        self.start_postgres()
        self.start_controller()
        limiter, layered = self.start_layered()
        spines = [self.start_spine(name) for name in SPINES]
        limiter.ready_line(self.left(), startswith="ratelimit serving")
        ready = layered.ready_json(self.left())
        components = (f"{len(ready['children'])} component processes" if self.containers is None
                      else f"{len(self.layered_components(self.work / 'layered'))} component containers")
        self.echo(f"  layered stack up: gateway {ready['address']}, {components} "
                  f"(+ the following rate limiter, pid {limiter.pid}), metrics {ready['metrics']}")
        for child in spines:
            self.echo_spine_ready(child, child.ready_json(self.left()))
        assert self.prometheus is not None
        self.prometheus.wait_all_up(self.left())
        self.start_clients()
        self.wait_stable()
        self.look_at_store("after bring-up")
        self.echo(f"up in {time.monotonic() - began:.1f}s")

    def look_at_store(self, when: str) -> None:
        """The shared store and every rate limiter's view of it, into the report and the log."""
        previous = self.report.store[-1] if self.report.store else None
        seen = look(when, self.redis.address, STORE_PREFIX, self.store_metrics(), previous)
        self.report.store.append(seen)
        self.echo("\n".join(seen.lines()))

    def echo_spine_ready(self, child: Child, ready: Mapping[str, Any]) -> None:
        follower = ready.get("follower") or {}
        fault = f", INJECTED FAULT {ready['injected_fault']}" if ready.get("injected_fault") else ""
        self.echo(f"  {child.name} up: gateway {ready['address']} ({ready['layout']}), metrics {ready['metrics']}, "
                  f"following the controller: applied {follower.get('applied_version')}{fault}")

    def wait_stable(self) -> None:
        """Before any plan the controller serves the stable state: the clients reach the layered side."""
        def served() -> bool:
            codes, layouts, _ = self.client_counts()
            status = self.status()
            acked = {p.node_id for p in status.data_planes if p.acked_version}
            return layouts.get("layered", 0) >= 3 and len(acked) >= self.options.clients and codes.get("OK", 0) >= 3

        self.wait_for("the proxyless clients to reach the layered side (the stable state)", served)
        status = self.status()
        planes = ", ".join(f"{node} {version}" for node, version in data_planes(status).items())
        self.echo(f"stable state served before any plan (100% layered): data planes {planes}; followers "
                  + ", ".join(f"{f.node_id} {f.acked_version}" for f in status.followers))

    def walk(self, key: str, title: str) -> RunRecord:
        """Start the plan and follow it until it finishes, printing each stage and window."""
        assert self._stub is not None
        run = self.report.runs[key] = RunRecord(title)
        plan = load_plan(self.options.plan_text)
        codes_before, layouts_before, errors_before = self.client_counts()
        self.echo(f"\n== {title}: plan {plan.name!r}, {len(plan.stages)} stages, window {plan.window_s:g}s")
        started = time.monotonic()
        self._stub.Start(migration_pb2.StartRequest(plan_yaml=self.options.plan_text, actor="rehearsal",
                                                    reason=title), metadata=self._md(), timeout=10)
        current: StageRecord | None = None
        published = started
        seen_windows = {(g.stage, g.window_end) for g in self.status().last_gates}  # an earlier run's
        layouts_at = layouts_before
        deadline = started + self.options.run_timeout_s
        status = self.status()
        while True:
            status = self.status()
            for window in new_windows(status, seen_windows):  # the stage's last window comes with the next one
                owner = next((r for r in reversed(run.stages) if r.name == window[0]["stage"]), current)
                if owner is not None:
                    owner.gates.append(window)
                self.echo("    window: " + "; ".join(gate_text(g) for g in window))
            if current is None or status.version != current.version:
                _, layouts_now, _ = self.client_counts()
                if current is not None:
                    current.answers = layouts_now - layouts_at
                    self.echo(f"    answers during it: {counts_text(current.answers)}")
                layouts_at, published = layouts_now, time.monotonic()
                current = StageRecord.published(status)
                run.stages.append(current)
                self.echo("\n".join(current.published_lines(status)))
            if status.applied and current.applied_after_s is None:
                current.note_applied(status, time.monotonic() - published)
                self.echo("\n".join(current.applied_lines()))
            if status.state in FINISHED and status.applied:
                break
            if time.monotonic() > deadline:
                raise RehearsalError(f"{title}: not finished within {self.options.run_timeout_s:g}s "
                                     f"(state {status.state}, stage {status.stage_name})")
            time.sleep(0.2)
        codes, layouts, errors = self.client_counts()
        current.answers = layouts - layouts_at
        self.echo(f"    answers during it: {counts_text(current.answers)}")
        run.final_state, run.seconds = status.state, time.monotonic() - started
        run.codes, run.layouts = codes - codes_before, layouts - layouts_before
        run.errors = errors[len(errors_before):]
        if status.state == "rolled_back":
            run.failed_gates = sorted({g.gate for g in status.last_gates if g.verdict == "fail" and not g.dry_run})
            run.rollback_reason = rollback_reason(status)
        self.echo(f"  {title}: {run.outcome()} after {run.seconds:.1f}s, spine {status.spine_weight:g}%; the proxyless "
                  f"clients got {counts_text(run.codes)}" + (f" (first errors: {run.errors[:3]})" if run.errors else ""))
        return run

    def restart_spines_with_fault(self) -> None:
        """Back to 100% layered, then a new spine build (the parity fault) on both replicas."""
        assert self._stub is not None
        self.echo("\n== a new spine build that answers differently: abort back to 100% layered, restart both "
                  "replicas with --inject-fault wrong-answers")
        self.begin_phase("restarting the replicas", self.options.start_timeout_s)
        self._stub.Abort(migration_pb2.CommandRequest(actor="rehearsal", reason="re-run with a new spine build"),
                         metadata=self._md(), timeout=10)
        status = self.wait_for("the abort to be ACKed", lambda: (s := self.status()).applied and s)
        self.echo(f"  aborted: {status.version} ACKed, spine {status.spine_weight:g}%")
        assert self.controller is not None
        log_from = self.controller.err.stat().st_size
        self.processes.stop_group([self.spines[name] for name in SPINES])
        restarted = [self.start_spine(name, fault="wrong-answers", generation=2) for name in SPINES]
        for child in restarted:
            self.echo_spine_ready(child, child.ready_json(self.left()))

        def rejoined() -> bool:
            status = self.status()
            spines = [f for f in status.followers if f.role == "spine" and f.acked_version.startswith(status.version)]
            return status.applied and len(spines) == len(SPINES)

        self.wait_for("both replicas to follow the controller again", rejoined)

        def endpoints_healthy() -> bool:
            """As an operator would before a rollout: the controller's health watch (which marks
            each endpoint HEALTHY or UNHEALTHY in EDS) has seen both replicas SERVING again."""
            assert self.controller is not None
            with self.controller.err.open(errors="replace") as log:
                log.seek(log_from)
                lines = log.read().splitlines()
            for port in self.spine_ports.values():
                about = [line for line in lines if f"gateway spine 127.0.0.1:{port} " in line]
                if about and "SERVING again" not in about[-1]:
                    return False
            return True

        self.wait_for("the controller to see both replicas SERVING (their endpoints HEALTHY in EDS)",
                      endpoints_healthy)
        # The clients' connections to the old replicas failed; they retry after their reconnect
        # backoff (capped at 1 s: spine.tools.rehearsal.client). A stage that sends traffic to
        # the spine before they are back would fail requests on the client, unseen by any gate.
        time.sleep(RECONNECT_GRACE_S)
        self.echo(f"  the controller sees both replicas SERVING; waited {RECONNECT_GRACE_S:g}s for the clients' "
                  f"reconnect backoff")
        assert self.prometheus is not None
        self.prometheus.wait_all_up(self.left())

    def run(self) -> Report:
        began = time.monotonic()
        try:
            self.bring_up()
            self.walk("healthy", "healthy spine")
            self.look_at_store("after the healthy walk")
            if self.options.parity_run:
                self.restart_spines_with_fault()
                self.walk("parity", "spine answering differently")
                self.look_at_store("after the parity walk")
        finally:
            self.shut_down()
            self.report.seconds = time.monotonic() - began
        return self.report

    def shut_down(self) -> None:
        if self._channel is not None:
            self._channel.close()
        with uninterrupted():  # a second Ctrl-C must not leave children behind
            try:
                self.processes.stop_all()
                if self.containers is not None:  # any container its stopped `podman run` left
                    self.containers.remove_all()
            finally:
                try:
                    if self.prometheus is not None and self.prometheus.process is not None:
                        pid = self.prometheus.process.pid
                        self.prometheus.stop()
                        self.processes.stopped.append(("prometheus", pid, 0))
                finally:  # the store last: every limiter gave its leases back first
                    if self.redis.process is not None:
                        pid = self.redis.process.pid
                        self.redis.stop()
                        self.processes.stopped.append(("redis", pid, 0))
        db = self.work / "rollout.db"
        try:
            if self.postgres is not None or db.exists():
                store = Store.open(self.postgres.dsn if self.postgres is not None else db)
                try:
                    self.report.gate_history = store.gate_history(1000)
                    self.report.audit = store.audit()
                    lease = store.lease() if self.postgres is not None else None
                    self.report.controller_store = (
                        f"PostgreSQL {self.postgres.describe()}, {len(self.report.audit)} audit rows; leader "
                        f"{lease.holder} at lease epoch {lease.epoch}" if self.postgres is not None and lease
                        else f"{store.backend} {len(self.report.audit)} audit rows")
                finally:
                    store.close()
        finally:
            self.stop_postgres()  # after the controller, which wrote to it to the end
            self.report.stopped = list(self.processes.stopped)


def run_rehearsal(options: Options) -> Report:
    """The whole rehearsal; the report says what happened (`Report.ok()`: as it should)."""
    import shutil

    workdir = options.workdir or Path(tempfile.mkdtemp(prefix="spine-rehearsal-", dir="/tmp"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        return Rehearsal(options, workdir).run()
    finally:
        if not options.keep and options.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spine.tools.rehearsal.run", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="a spine config laid under every process's (e.g. a model)")
    parser.add_argument("--plan", default=str(REHEARSAL_PLAN), help="the plan to walk (default: %(default)s)")
    parser.add_argument("--clients", type=int, default=2, help="proxyless gRPC clients (data planes)")
    parser.add_argument("--rate", type=float, default=8.0, help="requests per second per client")
    parser.add_argument("--no-parity-run", action="store_true", help="only the healthy walk")
    parser.add_argument("--workdir", help="keep everything (configs, logs, Prometheus data) here")
    parser.add_argument("--runtime", choices=("process", "podman"), default="process",
                        help="podman: every process a container of spine's image (make image), the layered components "
                             "one container each; Redis and Prometheus stay on the host")
    parser.add_argument("--image", help="the image RUNTIME=podman runs (default: the version tag make image builds)")
    parser.add_argument("--state-store", choices=("sqlite", "postgres"), default="sqlite",
                        help="the controller's state: a sqlite file, or a PostgreSQL server started for the run "
                             "(the store several controller replicas share, leader elected)")
    args = parser.parse_args(argv)
    from spine.tools.image import image_tag

    config = load_config(args.config).written() if args.config else None  # checked; laid under each role's
    options = Options(plan_text=Path(args.plan).read_text(), config=config, clients=args.clients, rate=args.rate,
                      parity_run=not args.no_parity_run, workdir=Path(args.workdir) if args.workdir else None,
                      runtime=args.runtime, image=args.image or (image_tag() if args.runtime == "podman" else None),
                      state_store=args.state_store)
    try:
        with sigterm_as_interrupt():
            report = run_rehearsal(options)
    except KeyboardInterrupt:
        print("interrupted: every process it started was stopped", file=sys.stderr)
        return 130
    except (RehearsalError, PrometheusError) as error:
        print(f"rehearsal failed: {error}", file=sys.stderr)
        return 1
    print(summary(report), flush=True)
    return 0 if report.ok() else 1


if __name__ == "__main__":
    sys.exit(main())
