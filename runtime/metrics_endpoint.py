"""Start the /metrics endpoint for whichever process hosts the metrics servicer."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any


def start_metrics_endpoint(servicer: Any, config: Mapping[str, Any], run_dir: Path,
                           local_inference: Callable[[], Any] = lambda: None,
                           local_ratelimit: Callable[[], Any] = lambda: None) -> Any:
    """Serve `servicer.registry` over HTTP (prometheus_client: text or OpenMetrics by the Accept
    header); write the address to run_dir/metrics.addr. The model's serving families come too:
    from `local_inference()` when the model runs in this process, else forwarded from its
    own endpoint (`runtime.serving_metrics`); and the rate limiter's shared-store
    families likewise (`local_ratelimit()`, `runtime.store_metrics`)."""
    from runtime.serving_metrics import attach_serving_metrics
    from runtime.store_metrics import StoreMetricsSource
    from services.common import section
    from services.common.prometheus_http import PrometheusHTTPServer
    from services.metrics.config import MetricsConfig

    attach_serving_metrics(servicer, local_inference, run_dir)
    servicer.registry.register(StoreMetricsSource(local_ratelimit, run_dir))
    settings = MetricsConfig.from_dict(section(config, "metrics"))
    endpoint = PrometheusHTTPServer(servicer.registry, listen=settings.http_listen,
                                    allow_external=settings.allow_external)
    endpoint.start()
    (run_dir / "metrics.addr").write_text(str(endpoint.address))
    return endpoint
