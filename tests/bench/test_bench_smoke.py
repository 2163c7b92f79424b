"""`python -m bench.run --quick` runs all three layouts end to end and writes the documented schema.

No timing assertions: numbers on a shared machine say nothing; the shape and sanity do.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = {"bare", "collapsed", "layered"}
HTTP_LAYOUTS = {"collapsed-http", "layered-http"}  # the same servers, called over their HTTP API


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _running_children() -> set[int]:
    pids = set()
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                pids.add(proc.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "tmp" / "results.json"
    before = _running_children()
    completed = subprocess.run([sys.executable, "-m", "bench.run", "--quick", "--out", str(out)], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=90)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    after = _running_children()
    assert after <= before, f"bench left processes running: {sorted(after - before)}"
    return json.loads(out.read_text())


def test_quick_bench_measures_every_layout_at_both_concurrencies(quick_results: dict) -> None:
    unary = {(r["layout"], r["concurrency"]) for r in quick_results["runs"] if r.get("mode", "unary") == "unary"}
    http = {(layout, 1) for layout in HTTP_LAYOUTS}  # the HTTP API only at c=1 and c=64
    assert unary == {(layout, c) for layout in LAYOUTS for c in (1, 16)} | http


def test_the_http_api_is_compared_with_grpc_on_the_same_server(quick_results: dict) -> None:
    rows = {(row["mode"], row["layout"]): row for row in quick_results["http_vs_grpc"]}
    assert set(rows) == {(mode, layout) for mode in ("unary", "stream") for layout in ("collapsed", "layered")}
    for row in rows.values():
        assert _positive(row["http_over_grpc_p50"]) and _positive(row["http_over_grpc_rps"])
        assert row["http_loop_cpu_us_per_request"] > 0, "the HTTP event loop's CPU is read by thread"


def test_every_run_has_positive_latency_throughput_and_memory(quick_results: dict) -> None:
    for run in quick_results["runs"]:
        where = f"{run['layout']} c={run['concurrency']} {run.get('mode')}"
        for key in ("p50_ms", "p99_ms", "rps", "peak_rss_mb"):
            assert _positive(run[key]), f"{where}: {key}={run[key]!r}"
        assert run["p99_ms"] >= run["p50_ms"], where
        assert isinstance(run["requests"], int) and run["requests"] > 0, where
        assert run["errors"] == 0, f"{where}: {run.get('error_codes')}"


def test_stream_runs_report_time_to_first_token_and_inter_token_latency(quick_results: dict) -> None:
    stream = [r for r in quick_results["runs"] if r.get("mode") == "stream"]
    assert {r["layout"] for r in stream} == LAYOUTS | set(HTTP_LAYOUTS)
    for run in stream:
        assert run["concurrency"] == 1
        for key in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"):
            assert _positive(run[key]), f"{run['layout']}: {key}={run[key]!r}"
        assert run["ttft_p50_ms"] <= run["p50_ms"]


def test_ratios_to_bare_and_machine_details_are_recorded(quick_results: dict) -> None:
    for run in quick_results["runs"]:
        for key in ("p50_vs_bare", "p99_vs_bare", "rps_vs_bare"):
            assert _positive(run[key]), f"{run['layout']}: {key}={run[key]!r}"
        if run["layout"] == "bare":
            assert run["p50_vs_bare"] == 1.0
    layered = {r["processes"] for r in quick_results["runs"] if r["layout"] == "layered"}
    collapsed = {r["processes"] for r in quick_results["runs"] if r["layout"] == "collapsed"}
    assert min(layered) > max(collapsed), "layered runs each component in its own process"
    machine = quick_results["machine"]
    assert machine["cpu_count"] >= 1 and machine["torch"]
    assert quick_results["started_at"]
    assert quick_results["processes_left_running"] == []


def test_each_cell_reports_every_rounds_throughput_ratio_to_bare(quick_results: dict) -> None:
    """The spread of a cell's rounds is what tells a reader how far its one ratio can be trusted."""
    rounds = quick_results["settings"]["rounds"]
    for run in quick_results["runs"]:
        where = f"{run['layout']} c={run['concurrency']} {run['mode']}"
        assert len(run["round_rps"]) == rounds and all(_positive(v) for v in run["round_rps"]), where
        ratios = run["rps_vs_bare_by_round"]
        assert len(ratios) == rounds and all(_positive(v) for v in ratios), where
        if run["layout"] == "bare":
            assert ratios == [1.0] * rounds


def test_round_ratios_pair_rounds_and_refuse_cells_that_do_not_match() -> None:
    from bench.report import round_ratios
    assert round_ratios([90.0, 120.0], [100.0, 100.0]) == [0.9, 1.2]
    assert round_ratios([90.0], [100.0, 100.0]) == []
    assert round_ratios([90.0, 50.0], [0.0, 100.0]) == [0.5]  # a round bare did not serve says nothing


def test_a_cells_spread_is_the_middle_half_of_its_rounds_not_their_extremes() -> None:
    from bench.report import spread
    assert spread([0.5, 0.9, 1.0, 1.1, 2.0]) == "0.90–1.10"
    assert spread([1.0]) == "" and spread(None) == ""


def test_each_run_reports_cpu_and_middleware_cost_per_request_and_the_plot_is_written(
        quick_results: dict, tmp_path_factory: pytest.TempPathFactory) -> None:
    for run in quick_results["runs"]:
        assert _positive(run["cpu_ms_per_request"]), run
        if run["layout"] != "bare" and run["mode"] == "unary":
            assert isinstance(run["middleware_us_per_request"], float)
            assert isinstance(run["middleware_cpu_us_per_request"], float)
    png = next(Path(tmp_path_factory.getbasetemp()).glob("bench*/tmp/results.png"))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_cold_path_tool_reports_every_phase_and_the_gap_to_the_servicer() -> None:
    """`python -m bench.cold_path` (the in-process c=1 measure) runs and prints each phase."""
    done = subprocess.run([sys.executable, "-m", "bench.cold_path", "--requests", "3", "--inline"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    for phase in ("begin", "admission", "model call", "answer trailers", "finish"):
        assert any(line.startswith(phase) and line.endswith("µs") for line in lines), done.stdout
    assert "inference servicer alone" in lines[-1]


def test_the_warm_path_tool_measures_the_spines_own_work_per_request() -> None:
    """`python -m bench.warm_path` (the spine's work with the model taken out) runs and
    prints the request path and the completions per request; bad sizes are refused."""
    done = subprocess.run([sys.executable, "-m", "bench.warm_path", "--windows", "3", "--window", "2"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    found = re.search(r"request path ([\d.]+) µs, completions ([\d.]+) µs \(windows of (\d+)\), total ([\d.]+) µs",
                      done.stdout)
    assert found, done.stdout
    path_us, writes_us, window, total_us = map(float, found.groups())
    assert path_us > 0 and writes_us > 0 and window == 2 and abs(total_us - path_us - writes_us) < 0.2, done.stdout
    refused = subprocess.run([sys.executable, "-m", "bench.warm_path", "--window", "0"], cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--window" in refused.stderr


def test_server_cpu_is_split_by_thread_and_the_decode_loop_is_told_apart(quick_results: dict) -> None:
    """Each run splits its server CPU by thread group; the model's decode loop and the gRPC
    handlers name themselves (`services.common.thread_names`), so their CPU does not land in
    `other` — which it would if the names were not given to the kernel."""
    spent: dict[str, dict[str, float]] = {}
    for run in quick_results["runs"]:
        groups = run["cpu_us_per_request_by_thread"]
        assert set(groups) == {"handlers", "model", "completions", "logs", "http-loop", "http-handlers",
                               "other"}, run
        for group, value in groups.items():
            spent.setdefault(run["layout"], {}).setdefault(group, 0.0)
            spent[run["layout"]][group] += value
    for layout in ("bare", "collapsed", "layered"):
        assert spent[layout]["model"] > 0, (layout, spent[layout])
        assert spent[layout]["handlers"] > 0, (layout, spent[layout])
    for layout in HTTP_LAYOUTS:  # called over HTTP: the HTTP threads, not the gRPC pool, do the work
        assert spent[layout]["http-loop"] > 0, (layout, spent[layout])
    # Both serve them on the HTTP loop itself, no handler thread: the spine with the model's
    # outputs handed to it, the layered gateway awaiting each process it calls there.
    assert spent["layered-http"]["http-handlers"] == 0, spent["layered-http"]
    assert spent["collapsed-http"]["http-handlers"] == 0, spent["collapsed-http"]


def test_thread_groups_and_the_split_table() -> None:
    from bench.report import thread_cpu_rows
    from bench.targets import thread_cpu_by_group, thread_group

    assert [thread_group(n) for n in ("grpc_12", "inference-sched", "spine-completio", "log-flusher:req",
                                      "event_engine", "python", "grpc_global_tim", "http-server", "http_3")] == [
        "handlers", "model", "completions", "logs", "other", "other", "other", "http-loop", "http-handlers"]
    before = {(1, 10): ("handlers", 1.0), (1, 11): ("model", 5.0)}
    after = {(1, 10): ("handlers", 1.5), (1, 11): ("model", 7.0), (1, 12): ("handlers", 0.25)}  # 12: a new thread
    assert thread_cpu_by_group(before, after) == {"handlers": 0.75, "model": 2.0, "completions": 0.0, "logs": 0.0,
                                                  "http-loop": 0.0, "http-handlers": 0.0, "other": 0.0}
    unary = [{"layout": "bare", "concurrency": 64, "cpu_us_per_request_by_thread": {"handlers": 100.0, "model": 900.0}},
             {"layout": "collapsed", "concurrency": 64,
              "cpu_us_per_request_by_thread": {"handlers": 260.0, "model": 910.0}},
             {"layout": "layered", "concurrency": 64, "cpu_us_per_request_by_thread": {"handlers": 1.0, "model": 1.0}}]
    assert thread_cpu_rows(unary) == [(64, "bare", {"handlers": 100.0, "model": 900.0}),
                                      (64, "collapsed", {"handlers": 260.0, "model": 910.0}),
                                      (64, "collapsed − bare", {"handlers": 160.0, "model": 10.0})]


def test_the_profile_report_ends_with_cpu_per_request_by_thread() -> None:
    from bench.profile import thread_table

    table = thread_table({"handlers": 0.5, "model": 1.5, "other": 0.0}, 1000)
    assert "  handlers          500 µs" in table and "  model            1500 µs" in table
    assert table.rstrip().endswith("total            2000 µs")
    assert thread_table({"handlers": 1.0}, 0) == ""  # nothing answered: no per-request figure


def test_the_profile_counts_a_thread_blocked_on_a_line_as_idle(tmp_path: Path) -> None:
    """A leaf frame standing on a lock's acquire (py-spy shows a C call's caller as the leaf)
    is a waiting thread, not self time; a leaf on a plain line is work."""
    from argparse import Namespace

    from bench.profile import summarize

    code = tmp_path / "worker.py"
    code.write_text("total = 0\ntotal += step()\nslot.wake.acquire()\nwith self._lock:\ntime.sleep(0.1)\n")
    stacks = [("work", 2, 30), ("submit", 3, 50), ("lead", 4, 5), ("rest", 5, 15)]
    raw = tmp_path / "profile.raw"
    raw.write_text("".join(f"process 1:\"python\";main (x.py:1);{name} ({code}:{line}) {count}\n"
                           for name, line, count in stacks))
    report = summarize(raw, 100.0, Namespace(layout="collapsed", concurrency=8, seconds=1.0))
    assert "30 of 100 samples busy" in report
    assert f"100.0%  work ({code}:2)" in report
    assert "submit" not in report and "lead" not in report


def test_the_profile_splits_each_threads_cpu_by_its_own_samples(tmp_path: Path) -> None:
    """py-spy's samples overstate the decode loop on a shared core (it only guesses which
    thread runs); the kernel's CPU per thread is exact. So the report shares each thread
    group's CPU out by that group's busy samples, not by the count of all samples."""
    from argparse import Namespace

    from bench.profile import summarize

    code = tmp_path / "work.py"
    code.write_text("total = 0\n")
    process = 'process 1:"python -m spine up"'
    stacks = [  # the model's thread has nine times the samples; the handlers half of its CPU
        ("inference-scheduler", f"TinyLM.forward ({tmp_path}/services/inference/model/tiny_lm.py:1)", 90),
        ("grpc_3", f"InferenceService._start ({tmp_path}/services/inference/service.py:1)", 2),  # the model's own service
        ("grpc_3", f"Pipeline.run ({tmp_path}/services/pipeline/pipeline.py:1)", 4),
        ("grpc_7", f"AuthStep.decide ({tmp_path}/services/auth/steps.py:1)", 4),
    ]
    raw = tmp_path / "profile.raw"
    raw.write_text("".join(f"{process};thread ({i}): {thread};run (x.py:1);{leaf} {n}\n"
                           for i, (thread, leaf, n) in enumerate(stacks)))
    args = Namespace(layout="collapsed", concurrency=16, seconds=1.0)
    report = summarize(raw, 100.0, args, {"handlers": 0.5, "model": 1.0, "completions": 0.1, "other": 0.0}, 1000)
    assert "  model                          1100 µs" in report  # 1000 from the decode loop + 100 of the handlers'
    assert "  pipeline                        200 µs" in report
    assert "  middleware services             200 µs" in report
    assert "  (unsampled: completions)        100 µs" in report  # CPU without samples is still shown
    assert "  handlers        500 µs (10 samples): pipeline 200, middleware services 200, model 100" in report
    # The same samples without the threads' CPU: shares of all busy samples, as before.
    unweighted = summarize(raw, 100.0, args)
    assert "share of busy samples by part of the code:" in unweighted and "   92.0%" in unweighted


def test_the_profile_against_bare_prints_what_the_layout_adds_part_by_part() -> None:
    from bench.profile import difference_table

    table = difference_table("collapsed", {"model": 2500.0, "pipeline": 190.0, "grpc": 170.0},
                             "bare", {"model": 2480.0, "grpc": 200.0, "other": 10.0})
    rows = table.splitlines()
    assert rows[0].startswith("CPU per request by part of the code, collapsed against bare")
    assert rows[2].split() == ["pipeline", "0", "190", "+190"]  # the largest addition first
    assert rows[-2].split() == ["grpc", "200", "170", "-30"]
    assert rows[-1].split() == ["total", "2690", "2860", "+170"]
