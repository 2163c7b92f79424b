"""Start the /metrics endpoint for whichever process hosts the metrics servicer."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from runtime.config.model import SpineConfig

log = logging.getLogger("runtime")


def start_metrics_endpoint(servicer: Any, config: SpineConfig, run_dir: Path,
                           local_inference: Callable[[], Any] = lambda: None,
                           local_ratelimit: Callable[[], Any] = lambda: None,
                           local_auth: Callable[[], Any] = lambda: None) -> Any:
    """Serve `servicer.registry` over HTTP (prometheus_client: text or OpenMetrics by the Accept
    header); write the address to run_dir/metrics.addr. The model's serving families come too:
    from `local_inference()` when the model runs in this process, else forwarded from its
    own endpoint (`runtime.observability.serving_metrics_export`); and the rate limiter's shared-store
    families likewise (`local_ratelimit()`, `runtime.observability.store_metrics`)."""
    from runtime.observability.serving_metrics_export import attach_serving_metrics
    from runtime.observability.store_metrics import StoreMetricsSource
    from services.common.prometheus_http import PrometheusHTTPServer

    attach_serving_metrics(servicer, local_inference, run_dir)
    servicer.registry.register(StoreMetricsSource(local_ratelimit, run_dir))
    servicer.registry.register(StoreMetricsSource(local_auth, run_dir, "auth"))
    settings = config.metrics
    endpoint = PrometheusHTTPServer(servicer.registry, listen=settings.http_listen,
                                    allow_external=settings.allow_external)
    endpoint.start()
    (run_dir / "metrics.addr").write_text(str(endpoint.address))
    return endpoint


class MetricsExports:
    """A layout's /metrics: the metrics component's endpoint when it runs here (with the
    rate limiter's shared-store families), else the local model's own; and the last
    Prometheus text, written at shutdown to run_dir/metrics.prom (nothing counted is lost)."""

    def __init__(self, local_servicers: Mapping[str, Any], config: SpineConfig, run_dir: Path,
                 local_inference: Callable[[], Any]) -> None:
        self.local_servicers = local_servicers
        self.config = config
        self.run_dir = run_dir
        self.local_inference = local_inference
        self.metrics_endpoint: Any = None
        self.inference_metrics: Any = None  # the model's own /metrics, when the metrics component is remote

    def start(self) -> None:
        metrics = self.local_servicers.get("metrics")
        if metrics is not None:
            # The rate limiter's shared-store families: from the one built here, whenever it
            # was (it leases while it exists), else from the run directory's own process.
            self.metrics_endpoint = start_metrics_endpoint(metrics, self.config, self.run_dir, self.local_inference,
                                                           lambda: self.local_servicers.get("ratelimit"),
                                                           lambda: self.local_servicers.get("auth"))
        elif "inference" in self.local_servicers:  # the metrics component is elsewhere
            from runtime.observability.serving_metrics_export import serve_inference_metrics

            self.inference_metrics = serve_inference_metrics(self.local_servicers["inference"], self.config,
                                                             self.run_dir)

    def stop(self) -> None:
        """Write the final metrics, then stop serving them."""
        metrics = self.local_servicers.get("metrics")
        if metrics is not None:
            try:
                (self.run_dir / "metrics.prom").write_text(metrics.render())
            except OSError as error:
                log.warning("could not write the final metrics to %s: %s", self.run_dir / "metrics.prom", error)
        for endpoint in (self.metrics_endpoint, self.inference_metrics):
            if endpoint is not None:
                endpoint.stop()
        self.metrics_endpoint = self.inference_metrics = None
