"""Start the /metrics endpoint for whichever process hosts the metrics servicer."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def start_metrics_endpoint(servicer: Any, config: Mapping[str, Any], run_dir: Path) -> Any:
    """Serve `servicer.registry` over HTTP (prometheus_client: text or OpenMetrics by the Accept
    header); write the address to run_dir/metrics.addr."""
    from services.prometheus_http import PrometheusHTTPServer

    section = config.get("metrics") or {}
    listen = str(section.get("http_listen", "127.0.0.1:0"))
    endpoint = PrometheusHTTPServer(servicer.registry, listen=listen,
                                    allow_external=bool(section.get("allow_external", False)))
    endpoint.start()
    (run_dir / "metrics.addr").write_text(str(endpoint.address))
    return endpoint
