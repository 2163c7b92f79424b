"""Start the /metrics endpoint for whichever process hosts the metrics servicer."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def start_metrics_endpoint(servicer: Any, config: Mapping[str, Any], run_dir: Path) -> Any:
    """Serve `servicer.registry` over HTTP (prometheus_client: text or OpenMetrics by the Accept
    header); write the address to run_dir/metrics.addr."""
    from services.common import section
    from services.prometheus_http import PrometheusHTTPServer
    from services.sections import MetricsConfig

    settings = MetricsConfig.from_dict(section(config, "metrics"))
    endpoint = PrometheusHTTPServer(servicer.registry, listen=settings.http_listen,
                                    allow_external=settings.allow_external)
    endpoint.start()
    (run_dir / "metrics.addr").write_text(str(endpoint.address))
    return endpoint
