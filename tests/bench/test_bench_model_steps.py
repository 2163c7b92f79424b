"""`make bench` reads how full each layout kept the model's batches (`Target.model_steps`)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from bench.report import run_record
from bench.targets import Target

METRICS = """# HELP spine_batch_size Sequences per model step.
# TYPE spine_batch_size histogram
spine_batch_size_bucket{model="tiny-lm",le="+Inf"} 40.0
spine_batch_size_count{model="tiny-lm"} 40.0
spine_batch_size_sum{model="tiny-lm"} 500.0
spine_batch_size_count{model="tiny-lm-mini"} 2.0
spine_batch_size_sum{model="tiny-lm-mini"} 4.0
spine_requests_total 7.0
"""


@pytest.fixture
def metrics_address() -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            body = METRICS.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _target(run_dir: Path) -> Target:
    return Target("collapsed", None, run_dir / "log", run_dir=run_dir)  # type: ignore[arg-type]


def test_the_model_figures_are_summed_over_models_and_read_once_per_model_process(
        tmp_path: Path, metrics_address: str) -> None:
    (tmp_path / "metrics.addr").write_text(metrics_address)  # the metrics endpoint alone (the spine)
    assert _target(tmp_path).model_steps() == (504.0, 42.0)

    # The layered stack: the model's own endpoint and the metrics process forwarding it.
    layered = tmp_path / "layered"
    (layered / "inference").mkdir(parents=True)
    (layered / "metrics.addr").write_text(metrics_address)
    (layered / "inference" / "inference.metrics.addr").write_text(metrics_address)
    assert _target(layered).model_steps() == (504.0, 42.0)


def test_an_endpoint_that_does_not_answer_counts_nothing(tmp_path: Path) -> None:
    (tmp_path / "metrics.addr").write_text("127.0.0.1:1")
    assert _target(tmp_path).model_steps() == (0.0, 0.0)
    assert Target("bare", None, tmp_path / "log").model_steps() == (0.0, 0.0)  # type: ignore[arg-type]


def test_a_record_says_steps_per_request_and_sequences_per_step() -> None:
    from bench.load import Call

    calls = [Call(True, 0.01) for _ in range(10)]
    record = run_record("collapsed", "unary", 16, calls, 1.0, 0, 0, model_stepped=(70.0, 5.0))
    assert record["model_steps_per_request"] == 0.5 and record["model_batch_mean"] == 14.0
    assert "model_batch_mean" not in run_record("bare", "unary", 16, calls, 1.0, 0, 0)  # nothing read
