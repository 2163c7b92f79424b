"""`spine ab`: workloads and traces, interleaved runs, the report, and bad input."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from runtime.running_stack import RunningStack
from services.common import ConfigError
from spine.cli import main
from spine.client.gateway_client import CallResult
from spine.tools.ab.command import run_command
from spine.tools.ab.interleave import ABRun, LayoutRun, RunOptions, run_interleaved
from spine.tools.ab.report import metric_rows, stream_timing
from spine.tools.ab.report import up_layouts as report_layouts
from spine.tools.ab.verdict import layout_verdicts, verdict_lines
from spine.tools.workload.generator import SyntheticSpec, synthetic, tenant_keys
from spine.tools.workload.recorded import TraceError, read_trace, write_trace
from tests.conftest import DEV_KEY, OTHER_KEY, config_for_tests, start_stack
from wire.v1 import generation_pb2

KEYS = {"dev": DEV_KEY, "other": OTHER_KEY}


def test_a_synthetic_workload_is_reproducible_and_follows_its_distributions() -> None:
    spec = SyntheticSpec(count=300, seed=11, prompt_words=(3, 6), max_tokens=(2, 5), tenants={"other": 1.0},
                         repeat_share=0.0, invalid_share=0.0, unauthenticated_share=0.0, cacheable_share=1.0)
    entries = synthetic(spec, KEYS)
    assert entries == synthetic(spec, KEYS)
    assert all(3 <= len(e.item.request.prompt.split()) <= 6 for e in entries)
    assert all(2 <= e.item.request.max_tokens <= 5 for e in entries)
    assert {e.item.token for e in entries} == {OTHER_KEY}
    assert all(e.item.request.temperature == 0.0 for e in entries)
    arrivals = [e.at for e in entries]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0


def test_bursts_arrive_at_the_same_instant() -> None:
    spec = SyntheticSpec(count=60, rate=10.0, burst_every_s=1.0, burst_size=5)
    arrivals = [e.at for e in synthetic(spec, KEYS)]
    assert arrivals.count(1.0) == 6  # the request that reached the burst, and five more with it


def test_a_workload_names_tenants_without_a_key() -> None:
    with pytest.raises(ConfigError, match=r"tenants: no dev API key for \['ghost'\]"):
        synthetic(SyntheticSpec(tenants={"ghost": 1.0}), KEYS)
    with pytest.raises(ConfigError, match=r"prompt_words: need 1 <= min <= max, got 5:2"):
        SyntheticSpec(prompt_words=(5, 2))


def test_a_recorded_trace_replays_the_same_requests(tmp_path: Path) -> None:
    entries = synthetic(SyntheticSpec(count=40, stream_share=0.3), KEYS)
    path = tmp_path / "trace.jsonl"
    assert write_trace(path, entries) == 40
    assert read_trace(path) == entries


@pytest.mark.parametrize(("line", "message"), [
    ('{"prompt": "a", "max_tokens": 2', r"trace\.jsonl:3: not valid JSON"),
    ('{"prompt": "a"}', r"trace\.jsonl:3: missing required field 'max_tokens'"),
    ('{"prompt": "a", "max_tokens": "2"}', r"trace\.jsonl:3: field 'max_tokens' must be int"),
    ('{"prompt": "a", "max_tokens": 2, "colour": 1}', r"trace\.jsonl:3: unknown field\(s\) \['colour'\]"),
    ('{"prompt": "a", "max_tokens": 2, "at": 0.1}', r"trace\.jsonl:3: 'at' goes back in time"),
    ("[1, 2]", r"trace\.jsonl:3: expected a JSON object"),
])
def test_a_malformed_trace_names_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text('{"prompt": "a", "max_tokens": 2, "at": 0.5}\n\n' + line + "\n")
    with pytest.raises(TraceError, match=message):
        read_trace(path)


def test_an_unreadable_trace_is_named(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"cannot read trace file .*missing\.jsonl"):
        read_trace(tmp_path / "missing.jsonl")
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(TraceError, match="not UTF-8"):
        read_trace(tmp_path / "binary.jsonl")


def test_the_cli_reports_a_bad_trace_line_before_starting_anything(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "max_tokens": 2}\nnot json\n')
    assert main(["ab", "--trace", str(path), "--out", str(tmp_path / "out")]) == 2
    assert "bad.jsonl:2: not valid JSON" in capsys.readouterr().err


# -- running -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def collapsed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    stack = start_stack("collapsed", tmp_path_factory.mktemp("ab"))
    try:
        yield stack
    finally:
        stack.stop()


def test_open_loop_sends_every_request_to_every_layout_at_its_arrival(collapsed: RunningStack) -> None:
    entries = synthetic(SyntheticSpec(count=12, rate=200.0, unauthenticated_share=0.0, invalid_share=0.0),
                        tenant_keys(config_for_tests().auth))
    runs = [LayoutRun("a", collapsed.address), LayoutRun("b", collapsed.address)]
    wall = run_interleaved(runs, entries, RunOptions(mode="open", time_limit_s=30, timeout_s=10))
    assert wall > entries[-1].at
    for run in runs:
        assert all(r is not None and r.ok for r in run.results)
        assert all(s is not None and r is not None and s >= r.latency_s
                   for s, r in zip(run.scheduled_latency_s, run.results, strict=True))


class _CountedRun(LayoutRun):
    """A layout whose clients count the calls in flight at it and at any other layout."""

    def __init__(self, name: str, address: str, counts: dict[str, int], seen: list[tuple[str, int, int]],
                 lock: threading.Lock) -> None:
        super().__init__(name, address)
        self.counts, self.seen, self.lock = counts, seen, lock

    def client(self) -> Any:
        run, real = self, super().client()

        class Counted:
            def _call(self, method: Any, *args: Any, **kwargs: Any) -> Any:
                with run.lock:
                    run.counts[run.name] += 1
                    others = sum(n for name, n in run.counts.items() if name != run.name)
                    run.seen.append((run.name, run.counts[run.name], others))
                try:
                    return method(*args, **kwargs)
                finally:
                    with run.lock:
                        run.counts[run.name] -= 1

            def generate(self, *args: Any, **kwargs: Any) -> Any:
                return self._call(real.generate, *args, **kwargs)

            def stream(self, *args: Any, **kwargs: Any) -> Any:
                return self._call(real.stream, *args, **kwargs)

            def close(self) -> None:
                real.close()

        return Counted()


def test_closed_loop_runs_each_layout_alone_at_the_whole_concurrency(collapsed: RunningStack) -> None:
    """Workers sending each request to every layout in turn piled up at the slower layout
    (more than the concurrency asked, and both layouts loaded at once): each layout now
    gets rounds of its own at exactly the concurrency, and every request still reaches both."""
    entries = synthetic(SyntheticSpec(count=48, unauthenticated_share=0.0, invalid_share=0.0),
                        tenant_keys(config_for_tests().auth))
    counts, lock = {"a": 0, "b": 0}, threading.Lock()
    seen: list[tuple[str, int, int]] = []
    runs = [_CountedRun(name, collapsed.address, counts, seen, lock) for name in ("a", "b")]
    run_interleaved(runs, entries, RunOptions(mode="closed", concurrency=4, time_limit_s=60, timeout_s=10))
    for run in runs:
        assert all(r is not None for r in run.results)  # answered (the tight tenant's refusals included)
    assert all(others == 0 for _, _, others in seen), "two layouts had calls in flight at once"
    assert {name: max(n for who, n, _ in seen if who == name) for name in counts} == {"a": 4, "b": 4}
    layouts_in_order = [name for name, _, _ in seen]
    turns = [name for i, name in enumerate(layouts_in_order) if i == 0 or layouts_in_order[i - 1] != name]
    # Three rounds of 16, the order rotating (a b | b a | a b): the layouts take turns.
    assert turns == ["a", "b", "a", "b"]


def test_a_run_stops_sending_at_its_time_limit(collapsed: RunningStack) -> None:
    entries = synthetic(SyntheticSpec(count=50, rate=5.0), tenant_keys(config_for_tests().auth))  # ~10 s of arrivals
    runs = [LayoutRun("a", collapsed.address)]
    run_interleaved(runs, entries, RunOptions(mode="open", time_limit_s=0.5, timeout_s=5))
    sent = sum(r is not None for r in runs[0].results)
    assert 0 < sent < 50


def test_ab_compares_layouts_side_by_side_and_reports_a_down_one(tmp_path: Path) -> None:
    # A mixed layout in its own process tree (logs in a child process), against a running
    # collapsed Gateway and an address where nothing answers.
    local = {name: "local" for name in ("auth", "ratelimit", "router", "cache", "metrics", "inference")}
    config = config_for_tests(placements={**local, "logs": "remote"})
    out = tmp_path / "report"
    trace = tmp_path / "recorded.jsonl"
    spec = SyntheticSpec(count=10, seed=3, max_tokens=(2, 4))
    running = start_stack("collapsed", tmp_path / "running", config)
    try:
        code = run_command(config, layouts=["mixed"], out_dir=out, spec=spec, record=trace,
                           targets={"running": running.address, "ghost": "127.0.0.1:1"},
                           # One worker: a repeated request then always finds its original's answer
                           # cached. With two, a repeat can race its original in flight, and hit in
                           # one layout and miss in the other (seen once in a full-suite run).
                           options=RunOptions(concurrency=1, time_limit_s=60, timeout_s=10, warmup=1,
                                              health_timeout_s=1.0))
    finally:
        running.stop()
    assert code == 1  # one target was down
    report = json.loads((out / "ab.json").read_text())
    assert report["layouts"]["ghost"]["status"] == "down"
    assert "not SERVING" in report["layouts"]["ghost"]["error"]
    mixed, other = report["layouts"]["mixed"], report["layouts"]["running"]
    for layout in (mixed, other):
        assert layout["status"] == "up" and layout["requests"] == 10
        assert set(layout["latency_ms"]) >= {"p50", "p90", "p99", "p99.9"}
    assert mixed["cpu_ms_per_request"] > 0 and mixed["peak_rss_bytes"] > 0  # its process tree, child included
    assert {"auth.check", "ratelimit.admit", "inference.generate", "logs.append"} <= set(
        mixed["middleware_ms_per_request"])
    # One worker: about one request at most in the model on average (its span can outlast
    # the client's wait by a little: a stream's ends when the servicer's generator does).
    # The warm-up's spans are dropped: with them (a fresh process's first calls) it was 1.8.
    in_model = dict(metric_rows(report))["mean requests in the model"][report_layouts(report).index("mixed")]
    assert 0.0 < float(in_model) <= 1.2
    assert mixed["traced_requests"] == 10  # the workload's, not the warm-up's
    # One span per request and middleware at most (the tracing hook was once added twice).
    assert max(mixed["span_counts"].values()) == 10 and mixed["span_counts"]["auth.check"] <= 10
    parity = report["parity"]
    assert parity["base"] == "mixed"
    assert parity["vs"]["running"]["compared"] == 10
    assert parity["vs"]["running"]["identical"] == 10
    # Ten requests a layout say nothing with a confidence: the verdict cannot tell, never a pass.
    verdict = report["verdict"]
    assert verdict["base"] == "mixed" and verdict["vs"]["running"]["outcome"] == "cannot tell"
    assert len(read_trace(trace)) == 10
    markdown = (out / "report.md").read_text()
    assert "## Verdict" in markdown and "running vs mixed: cannot tell" in markdown
    assert "ghost is DOWN" in markdown and "![latency_cdf](latency_cdf.png)" in markdown
    assert (out / "latency_cdf.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "middleware_time.png").read_bytes()[:4] == b"\x89PNG"


def test_the_verdict_flags_a_layout_ten_percent_slower_with_its_confidence() -> None:
    rng = np.random.default_rng(1)

    def run(name: str, median_ms: float) -> LayoutRun:
        results: list[CallResult | None] = [CallResult(grpc.StatusCode.OK, "", float(v) / 1000.0)
                                            for v in rng.lognormal(np.log(median_ms), 0.2, 300)]
        return LayoutRun(name, results=results + [CallResult(grpc.StatusCode.INVALID_ARGUMENT, "bad", 0.001)])

    verdict = layout_verdicts(ABRun([run("layered", 20.0), run("collapsed", 22.0)], 1.0, RunOptions()))
    collapsed = verdict["vs"]["collapsed"]
    latency = next(m for m in collapsed["metrics"] if m["name"] == "latency")
    assert latency["verdict"] == "high" and latency["p_value"] < 0.02 and 0 < latency["low"] < latency["effect"]
    assert collapsed["outcome"] == "fail" and collapsed["score"] == 50.0  # a refused request is no layout error
    assert next(m for m in collapsed["metrics"] if m["name"] == "error_rate")["verdict"] == "pass"
    lines = verdict_lines({"verdict": verdict})
    assert lines[0] == "collapsed vs layered: fail, score 50 (judged at 98% confidence)"
    assert lines[1].startswith("  latency: high: collapsed latency shifted +")


def test_stream_timing_reads_the_decode_speed_from_the_chunks_and_leaves_cache_hits_out() -> None:
    def streamed(first_s: float, chunks: int, per_chunk_s: float, cached: bool = False) -> CallResult:
        result = CallResult(grpc.StatusCode.OK, "", first_s + (chunks - 1) * per_chunk_s, first_chunk_s=first_s)
        result.chunks = [generation_pb2.GenerateChunk(index=i, cached=cached) for i in range(chunks)]
        return result

    unary = CallResult(grpc.StatusCode.OK, "", 0.05, response=generation_pb2.GenerateResponse(text="x"))
    failed = CallResult(grpc.StatusCode.UNAVAILABLE, "down", 0.001)
    timing = stream_timing([streamed(0.010, 9, 0.002), streamed(0.030, 5, 0.004), streamed(0.020, 3, 0.003),
                            streamed(0.001, 1, 0.0, cached=True), unary, failed])
    assert timing is not None and timing["count"] == 3
    assert timing["ttft_ms_p50"] == pytest.approx(20.0)
    assert timing["ms_per_chunk_p50"] == pytest.approx(3.0)
    assert stream_timing([unary, failed]) is None
