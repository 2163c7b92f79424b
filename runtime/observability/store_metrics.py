"""How the families of the components' shared stores reach /metrics, in every layout: the rate
limiter's (`spine_ratelimit_store_*`, and `spine_spend_*` with `ratelimit.spend`) and auth's
managed keys (`spine_auth_key_store_*`).

A rate limiter with `ratelimit.store` keeps its lease state in its own process
(`services.ratelimit.leases`). Where it runs decides how its families are served, as for the
model's serving families (`runtime.observability.serving_metrics_export`):

* **in the process of the metrics component** (the spine, any stage whose spine built a
  rate limiter): the metrics component's registry reads its collector, so the one /metrics
  has them;
* **in a process of its own** (the layered rate limiter, or one following the controller):
  it serves them at /metrics on `ratelimit.store.metrics_listen` (loopback unless
  `metrics.allow_external`) and writes the address to its run directory
  (`ratelimit.metrics.addr`); the metrics component of the same run directory forwards them
  at scrape time, so the address `spine up` prints shows them in the layered layout too.
  Where they share no run directory (a cluster), Prometheus scrapes the limiter's own
  endpoint, so no series is exported twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector, CollectorRegistry

from runtime.config.model import SpineConfig
from runtime.observability.serving_metrics_export import forwarded
from services.common.prometheus_http import PrometheusHTTPServer

log = logging.getLogger("runtime")

ADDRESS_FILE = "ratelimit.metrics.addr"
# The components whose servicer may have a `store_collector`.
STORE_COMPONENTS = ("ratelimit", "auth")


def address_file(component: str) -> str:
    """Where a component's own /metrics address is written in its run directory."""
    return f"{component}.metrics.addr"


class StoreMetricsSource(Collector):
    """On the metrics component's registry: the store families of the component `local()`
    returns (one was built in this process), else forwarded from the run directory's own."""

    def __init__(self, local: Callable[[], Any], run_dir: Path, component: str = "ratelimit") -> None:
        self._local = local
        self._address_file = run_dir / address_file(component)

    def collect(self) -> Iterator[Metric]:
        collector = getattr(self._local(), "store_collector", None)
        if collector is not None:
            yield from collector.collect()
            return
        yield from forwarded(self._address_file)


def serve_store_metrics(servicer: Any, config: SpineConfig, run_dir: Path,
                        component: str = "ratelimit") -> PrometheusHTTPServer | None:
    """A component process's own /metrics with its store families (None: it has none); its
    address goes to run_dir/<component>.metrics.addr. The rate limiter's listens on
    `ratelimit.store.metrics_listen` when it has a store, any other on a free loopback port."""
    collector = getattr(servicer, "store_collector", None)
    if collector is None:
        return None
    store = config.ratelimit.store if component == "ratelimit" else None
    registry = CollectorRegistry()
    registry.register(collector)
    allow_external = config.metrics.allow_external
    endpoint = PrometheusHTTPServer(registry, listen=store.metrics_listen if store is not None else "127.0.0.1:0",
                                    allow_external=allow_external)
    endpoint.start()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / address_file(component)).write_text(endpoint.address)
    log.info("%s store metrics on http://%s/metrics", component, endpoint.address)
    return endpoint
