"""How the model server's serving metrics reach /metrics, in every layout.

The inference servicer keeps its serving families (KV slots, queue depth, batch size,
TTFT, ITL, device budget, GPU; `services.inference.serving_metrics`) on a registry of its own.
Where it runs decides how they are served:

* **in the process of the metrics component** (the spine, a stage with both local): its
  collector is read by the metrics component's registry, so the one /metrics has
  everything;
* **in a process of its own** (the layered inference child, or the spine while the
  metrics component is still remote): it serves its registry at /metrics on
  `inference.metrics_listen` (loopback unless `metrics.allow_external`) and writes the
  address to the run directory (`inference.metrics.addr`). The metrics component's
  /metrics forwards those families at scrape time (one HTTP GET, `FORWARD_TIMEOUT_S`), so
  the address `spine up` prints shows everything in every layout. Where processes share no
  run directory (a cluster: one pod each), nothing is forwarded and Prometheus scrapes the
  inference pod's own endpoint, so no series is ever exported twice.

Whichever way, a family reads the same: one code (`ServingCollector`) makes it.
"""

from __future__ import annotations

import logging
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from runtime.config.model import SpineConfig
from services.common.prometheus_http import PrometheusHTTPServer

log = logging.getLogger("runtime")

ADDRESS_FILE = "inference.metrics.addr"
FORWARD_TIMEOUT_S = 1.0


class ServingMetricsSource(Collector):
    """On the metrics component's registry: the model's serving families, from the servicer
    `local()` returns (the model runs here now), else forwarded from its own endpoint."""

    def __init__(self, local: Callable[[], Any], run_dir: Path) -> None:
        self._local = local
        self._address_file = run_dir / ADDRESS_FILE

    def collect(self) -> Iterator[Metric]:
        servicer = self._local()
        collector = getattr(servicer, "serving_collector", None)
        if collector is not None:
            yield from collector.collect()
            return
        yield from self._forwarded()

    def _forwarded(self) -> Iterator[Metric]:
        yield from forwarded(self._address_file)


def forwarded(address_file: Path) -> Iterator[Metric]:
    """The families another process of this run directory serves at the address in
    `address_file`; none when there is no such file or the process does not answer in
    `FORWARD_TIMEOUT_S` (it is restarting: this scrape goes without)."""
    try:
        address = address_file.read_text().strip()
    except OSError:
        return  # no such endpoint in this run directory
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=FORWARD_TIMEOUT_S) as answer:
            text = answer.read().decode()
    except OSError as error:
        log.debug("metrics from %s (%s) not forwarded: %s", address, address_file.name, error)
        return
    yield from text_string_to_metric_families(text)


def attach_serving_metrics(metrics_servicer: Any, local: Callable[[], Any], run_dir: Path) -> None:
    """Let the metrics component's /metrics (and its Scrape rpc) show the model's serving families."""
    metrics_servicer.registry.register(ServingMetricsSource(local, run_dir))


def serve_inference_metrics(servicer: Any, config: SpineConfig, run_dir: Path) -> PrometheusHTTPServer:
    """The model's own /metrics, where the metrics component runs in another process; its
    address goes to run_dir/inference.metrics.addr (for forwarding, and for people)."""

    listen = config.inference.metrics_listen
    allow_external = config.metrics.allow_external
    endpoint = PrometheusHTTPServer(servicer.metrics_registry, listen=listen, allow_external=allow_external)
    endpoint.start()
    (run_dir / ADDRESS_FILE).write_text(endpoint.address)
    log.info("inference serving metrics on http://%s/metrics", endpoint.address)
    return endpoint
