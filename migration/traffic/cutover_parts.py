"""The parts both cutovers start the same way, each stopped by the `ExitStack` it joins.

A cutover (`cutover.Cutover`, the built-in one; `legacy_cutover.LegacyCutover`, from a foreign
HTTP endpoint) starts its parts one after another under one `ExitStack`, and its running record
is a `RunningParts` (`runtime.running_parts`): a part that fails to start unwinds the ones
before it, and a running cutover stops in the reverse of the order it started in. The pieces both
start (the front's comparison counters served for the parity gate, the controller) are here
so that the two cutovers share them rather than repeat them.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.registry import Collector

from migration.metrics.scrape import ScrapeSource
from migration.server import ControllerProcess
from migration.target import TrafficTarget
from runtime.processes.run_dir import write_private
from services.common.prometheus_http import PrometheusHTTPServer

# How often the parity gate reads the front's comparisons: a window of a second holds several reads.
PARITY_INTERVAL_S = 0.25


@dataclass(frozen=True)
class Comparisons:
    """The front's shadow comparison counters on a /metrics of their own, and the source the
    parity gate reads them with (the same `ScrapeSource` a direct scrape of spines uses)."""

    metrics: PrometheusHTTPServer
    parity: ScrapeSource


def serve_comparisons(parts: ExitStack, registry: Collector) -> Comparisons:
    """Serve `registry` on loopback and start reading it; both stop with `parts`."""
    metrics = PrometheusHTTPServer(registry)
    metrics.start()
    parts.callback(metrics.stop)
    parity = ScrapeSource({"front": [f"http://{metrics.address}/metrics"]}, interval_s=PARITY_INTERVAL_S)
    parts.callback(parity.close)
    return Comparisons(metrics, parity)


def controller_address(run_dir: Path) -> str:
    """Where a cutover's controller serves `MigrationControl`: a unix socket in its run directory."""
    return f"unix:{run_dir / 'controller.sock'}"


def start_controller(parts: ExitStack, run_dir: Path, admin_token: str, target: TrafficTarget, *,
                     tick_s: float, dashboard_listen: str | None) -> ControllerProcess:
    """The migration controller over `target` (sqlite state in `run_dir`, the admin token in a
    file only this user reads, for `spine migrate --admin-token-file`); it stops with `parts`."""
    write_private(run_dir, "admin-token", admin_token).chmod(0o600)
    controller = ControllerProcess(str(run_dir / "migration.sqlite"), controller_address(run_dir), admin_token,
                                   target, tick_s=tick_s, dashboard_listen=dashboard_listen,
                                   view_without_token=True)
    parts.callback(controller.stop)  # before it starts: one that fails half way stops what it had begun
    controller.start()
    return controller
