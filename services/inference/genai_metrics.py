"""The GenAI model server metrics of OpenTelemetry's semantic conventions, for each served model.

The inference component is the GenAI model server in every layout; each request it serves
(`InferenceService.Generate` / `GenerateStream`) is observed once, when it ends
(`services.common.genai_semconv` has the names, units, buckets and labels):

- `gen_ai_server_request_duration_seconds`: from the request reaching the model server to
  its answer or its stream's last chunk, every request (`error_type`: the gRPC status code's
  name of one that ended in an error, a refusal or a cancel included);
- `gen_ai_server_time_to_first_token_seconds`: to its first token computed, queueing and
  prefill included, for answered requests;
- `gen_ai_server_time_per_output_token_seconds`: between its first and last tokens, per token
  after the first, for answered requests of more than one token.

Plain counts under a lock (`serving_metrics.Counts`), read at scrape time by the serving
collector; the scheduler only notes each job's first and last token's time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from services.common import genai_semconv as semconv
from services.inference.serving_metrics import GENAI_FAMILIES as FAMILIES
from services.inference.serving_metrics import Counts


@dataclass
class ServedRequest:
    """One request while the model server serves it; the servicer sets `job` once it has one."""

    started: float
    job: Any = None


class GenAiServerStats:
    """The three families' counts for one served model, by operation and error."""

    def __init__(self, model: str) -> None:
        self.model = model
        self._lock = threading.Lock()
        self._series: dict[tuple[str, str, str], Counts] = {}  # (family, operation, error) -> counts

    @contextmanager
    def serving(self, request: Any) -> Iterator[ServedRequest]:
        """Around the handling of `request`: observes it when it ends, however it ends."""
        served = ServedRequest(time.perf_counter())
        error = ""
        try:
            yield served
        except BaseException as exc:  # an abort, a cancel (GeneratorExit: the reader left), a failure
            error = _error_type(exc)
            raise
        finally:
            self._finished(semconv.operation_name(request), error, served)

    def _finished(self, operation: str, error: str, served: ServedRequest) -> None:
        ended = time.perf_counter()
        job = served.job
        first = getattr(job, "first_token_pc", 0.0) if job is not None else 0.0
        with self._lock:
            self._observe(semconv.SERVER_REQUEST_DURATION.family, operation, error, ended - served.started)
            if error or not first:
                return
            self._observe(semconv.SERVER_TIME_TO_FIRST_TOKEN.family, operation, "", first - job.submitted_pc)
            if job.tokens > 1:
                per_token = (job.last_token_pc - first) / (job.tokens - 1)
                self._observe(semconv.SERVER_TIME_PER_OUTPUT_TOKEN.family, operation, "", per_token)

    def _observe(self, family: str, operation: str, error: str, value: float) -> None:
        key = (family, operation, error)
        counts = self._series.get(key)
        if counts is None:
            buckets = next(m.buckets for m in FAMILIES if m.family == family)
            counts = self._series[key] = Counts(buckets)
        counts.observe(value)

    def add_to(self, families: dict[str, Any]) -> None:
        """Every series into `families` (HistogramMetricFamily by family name)."""
        with self._lock:
            series = [(key, counts.buckets(), counts.sum) for key, counts in sorted(self._series.items())]
        for (family, operation, error), buckets, total in series:
            labels = [operation, semconv.PROVIDER, self.model, self.model]
            if family == semconv.SERVER_REQUEST_DURATION.family:
                labels.append(error)
            families[family].add_metric(labels, buckets, total)


def _error_type(exc: BaseException) -> str:
    """The gRPC status code's name a request ended with (the model raises its refusals as
    `grpc.RpcError`s; anything else is UNKNOWN, as gRPC makes of it)."""
    if isinstance(exc, GeneratorExit):
        return "CANCELLED"
    code = getattr(exc, "code", None)
    try:
        value = code() if callable(code) else None
    except Exception:
        value = None
    name = getattr(value, "name", None)
    return name if isinstance(name, str) and name != "OK" else "UNKNOWN"
