"""What the GenAI telemetry costs a request, with tracing off (and, beside it, on).

    python -m bench.genai_cost [--iterations 20000]
    python -m bench.run --only genai_telemetry        (into bench/results.json)

A microbenchmark of the work the GenAI semantic conventions added to a request's path, in
this process, warm: one request's path is run with that work and without it, the two
interleaved iteration by iteration (so the host's slow spells fall on both alike), each
iteration timed alone; the cost is the difference of their medians (`without_p50_us` is the
same pieces without the GenAI work: the record built, encoded and counted). The path, as a request
meets it in the layered layout, where all of it is on the path (in the spine the record's
encoding is not done and its counting is deferred off the path):

- the gateway: the call's `ModelCall`, the tracing-off context around the model call, a
  stream's first chunk, the duration when the request ends;
- the metrics record the pipeline builds (the GenAI fields), its encoding for the wire
  (`RecordBatch`) and its counting in the metrics service (the GenAI tables);
- the model server: the `serving` observation around the request (three histograms).

`tracing off` is what every request pays (tracing is off by default). Beside it, with tracing
on: `sampled out` (a ratio of 0: a non-recording span per model call) and `recorded` (every
span recorded, ended into the SDK's span processor; exporting is off the path).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

from monolith.device import DeviceContext
from runtime.observability.genai_spans import GenAiSpans
from runtime.observability.tracing import SpanTimes, Tracing
from services.gateway.model_calls import NOT_TRACED, first_chunk
from services.inference.genai_metrics import GenAiServerStats
from services.metrics.api import _encode_records
from services.metrics.config import MetricsConfig
from services.metrics.service import MetricsService
from services.metrics.steps import _record as metrics_record
from services.pipeline.state import ModelCall, RequestState
from wire.v1 import generation_pb2

TARGET_MS = 0.1  # the p50 the telemetry may add to a request's path with tracing off


class _Job:
    """What the model server's observation reads of a job (its first and last tokens)."""

    submitted_pc = first_token_pc = last_token_pc = time.perf_counter()
    tokens = 8


REQUEST = generation_pb2.GenerateRequest(model="tiny-lm", prompt="what does it cost", max_tokens=8)
RESPONSE = generation_pb2.GenerateResponse(model="tiny-lm", finish_reason="length", prompt_tokens=17,
                                           completion_tokens=8)


def _fresh_state() -> RequestState:
    """A request's state as the gateway hands it to the completions (a new one each time)."""
    return RequestState(request=REQUEST, request_id="bench", layout="layered", started=time.perf_counter(),
                        deadline=time.monotonic() + 60, shadow=False, metadata=(), tenant="dev", model="tiny-lm",
                        resolved=REQUEST, response=RESPONSE, completion_tokens=8, latency_s=0.01)


def _path(metrics: MetricsService, server: GenAiServerStats, spans: GenAiSpans | None) -> Callable[[bool], None]:
    """One request's path with (True) or without (False) the GenAI telemetry."""
    job = _Job()

    def run(genai: bool) -> None:
        state = _fresh_state()
        if genai:
            state.model_call = ModelCall(True, time.perf_counter())
            with NOT_TRACED if spans is None else spans.calling(state):
                pass  # the model call
            first_chunk(state)
            state.model_call.duration_s = time.perf_counter() - state.model_call.started
            if spans is not None:
                spans.end(state)
            with server.serving(state.resolved) as served:
                served.job = job
        record = metrics_record(state)
        _encode_records([record])
        metrics.record([record])
    return run


def _medians(run: Callable[[bool], None], iterations: int) -> tuple[float, float]:
    """p50 µs of the path without and with the telemetry, interleaved."""
    without: list[float] = []
    with_: list[float] = []
    clock = time.perf_counter_ns
    for i in range(iterations + iterations // 10):
        order = (False, True) if i % 2 else (True, False)
        for genai in order:
            started = clock()
            run(genai)
            elapsed = (clock() - started) / 1000.0
            if i >= iterations // 10:  # the first tenth warms up
                (with_ if genai else without).append(elapsed)
    return statistics.median(without), statistics.median(with_)


def measure(iterations: int = 20_000) -> dict[str, Any]:
    device = DeviceContext()
    rows: dict[str, dict[str, float]] = {}
    variants: dict[str, Tracing | None] = {
        "tracing_off": None,
        "tracing_sampled_out": Tracing(sample_ratio=0.0),
        "tracing_recorded": Tracing(sample_ratio=1.0, processors=[SpanTimes()]),
    }
    gc_was = gc.isenabled()
    gc.disable()  # a collection lands on one side or the other; it is nobody's cost here
    try:
        for name, tracing in variants.items():
            metrics = MetricsService(MetricsConfig(), device)
            spans = GenAiSpans(tracing.tracer) if tracing is not None else None
            base, added = _medians(_path(metrics, GenAiServerStats("tiny-lm"), spans), iterations)
            rows[name] = {"without_p50_us": round(base, 2), "with_p50_us": round(added, 2),
                          "added_p50_us": round(added - base, 2)}
            if tracing is not None:
                tracing.shutdown()
    finally:
        if gc_was:
            gc.enable()
    off = rows["tracing_off"]["added_p50_us"]
    return {"iterations": iterations, "target_ms": TARGET_MS, "added_p50_ms_tracing_off": round(off / 1000.0, 4),
            "within_target": off / 1000.0 <= TARGET_MS, **rows}


def describe(row: dict[str, Any]) -> str:
    return (f"GenAI telemetry: +{row['tracing_off']['added_p50_us']} µs p50 per request with tracing off "
            f"(target ≤ {row['target_ms'] * 1000:g} µs; the same pieces without it "
            f"{row['tracing_off']['without_p50_us']} µs), "
            f"+{row['tracing_sampled_out']['added_p50_us']} µs sampled out, "
            f"+{row['tracing_recorded']['added_p50_us']} µs with every span recorded")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=20_000)
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        print(describe(measure(args.iterations)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
