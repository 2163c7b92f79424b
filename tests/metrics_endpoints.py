"""Real /metrics endpoints for the gates' sources: a MetricsService behind its HTTP server.

Each stands for one process (one pod) of a side. `restart()` replaces the service with a
fresh one on the same port: what a crashed and restarted process looks like to a scraper.
"""

from __future__ import annotations

from typing import Any

import torch

from monolith.device import DeviceContext
from services.common.prometheus_http import PrometheusHTTPServer
from services.metrics.service import MetricsConfig, MetricsService
from wire.v1 import metrics_pb2


class MetricsEndpoint:
    def __init__(self, layout: str) -> None:
        self.layout = layout
        self.service = self._fresh()
        self.server = PrometheusHTTPServer(self.service.registry, "127.0.0.1:0")
        self.server.start()
        self.address = self.server.address

    @staticmethod
    def _fresh() -> MetricsService:
        return MetricsService(MetricsConfig(), DeviceContext(device=torch.device("cpu")))

    @property
    def url(self) -> str:
        return f"http://{self.address}/metrics"

    def record(self, count: int, status: str = "OK", latency_s: float = 0.001, **extra: Any) -> None:
        records = [metrics_pb2.RequestRecord(layout=self.layout, model="tiny-lm", tenant="dev", status=status,
                                             latency_s=latency_s, **extra) for _ in range(count)]
        answer = self.service.RecordBatch(metrics_pb2.RecordBatchRequest(records=records))
        assert not any(result.code for result in answer.results), answer

    def restart(self) -> None:
        """A new process on the same address: every counter starts again from zero."""
        self.server.stop()
        self.service = self._fresh()
        self.server = PrometheusHTTPServer(self.service.registry, self.address)
        self.server.start()

    def stop(self) -> None:
        self.server.stop()
