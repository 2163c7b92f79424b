"""Turn timed calls into run records, ratios, a rich table and results.json."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import statistics
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import psutil
from rich.console import Console
from rich.table import Table

from bench.load import Call
from bench.targets import server_cpu
from runtime.observability.stats import percentile
from services.inference.cpu_placement import ENV as CPU_PLACEMENT_ENV

MB = 1024 * 1024


def _ms(values_s: Sequence[float], q: float) -> float:
    return round(percentile([v * 1000.0 for v in values_s], q), 3)


def run_record(layout: str, mode: str, concurrency: int, calls: Sequence[Call], wall_s: float, unsent: int,
               peak_rss_bytes: int, cpu_s: float = 0.0,
               cpu_by_thread_s: Mapping[str, float] | None = None,
               round_rps: Sequence[float] = (), model_stepped: tuple[float, float] = (0.0, 0.0)) -> dict[str, Any]:
    """One row of results.json: latency percentiles over successful calls, throughput, errors,
    the server's CPU per request (its whole process tree, and per group of threads:
    `bench.targets.THREAD_GROUPS`), the throughput of each of the cell's rounds, and how full
    the model's batches were (`model_stepped`: sequences and steps over the cell's rounds,
    `Target.model_steps`)."""
    ok = [call for call in calls if call.ok]
    record: dict[str, Any] = {
        "layout": layout, "mode": mode, "concurrency": concurrency,
        "p50_ms": _ms([c.latency_s for c in ok], 50), "p99_ms": _ms([c.latency_s for c in ok], 99),
        "rps": round(len(ok) / wall_s, 3) if wall_s > 0 else 0.0,
        "requests": len(calls), "errors": len(calls) - len(ok), "unsent": unsent,
        "wall_s": round(wall_s, 3), "peak_rss_mb": round(peak_rss_bytes / MB, 1),
        "cpu_ms_per_request": round(1000.0 * cpu_s / len(ok), 4) if ok else None,
    }
    if round_rps:
        record["round_rps"] = [round(value, 3) for value in round_rps]
    if cpu_by_thread_s and ok:
        record["cpu_us_per_request_by_thread"] = {group: round(1e6 * seconds / len(ok), 1)
                                                  for group, seconds in cpu_by_thread_s.items()}
    sequences, steps = model_stepped
    if steps > 0 and ok:
        record["model_steps_per_request"] = round(steps / len(ok), 3)
        record["model_batch_mean"] = round(sequences / steps, 2)
    codes = sorted({c.code for c in calls if not c.ok})
    if codes:
        record["error_codes"] = {code: sum(1 for c in calls if c.code == code) for code in codes}
    if mode == "stream":
        ttft = [c.ttft_s for c in ok if c.ttft_s is not None]
        itl = [gap for c in ok for gap in c.itl_s]
        record.update(ttft_p50_ms=_ms(ttft, 50), ttft_p99_ms=_ms(ttft, 99),
                      itl_p50_ms=_ms(itl, 50), itl_p99_ms=_ms(itl, 99))
    return record


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b and a == a and b == b else None  # NaN-safe: x == x is False for NaN


def round_ratios(layout_rps: Sequence[float], bare_rps: Sequence[float]) -> list[float]:
    """Each round's throughput over bare's in the same round (same prompts, turns next to each
    other). Why: the host's speed drifts over minutes, so one cell's ratio can move between
    runs by more than a target's margin; the spread of its rounds says how far to trust it."""
    if len(layout_rps) != len(bare_rps):
        return []
    return [ratio for a, b in zip(layout_rps, bare_rps, strict=True) if (ratio := _ratio(a, b)) is not None]


def spread(values: Sequence[float] | None) -> str:
    """The middle half of a cell's per-round ratios (first to third quartile; "" when it has
    fewer than two). Not min–max: at c=1 a cell has many short rounds, and its extremes say
    more about a half-second of the host than about the layout."""
    if not values or len(values) < 2:
        return ""
    first, _, third = statistics.quantiles(values, n=4, method="inclusive")
    return f"{first:.2f}–{third:.2f}"


def add_ratios(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Annotate each run with its ratio to bare; return layered-vs-collapsed per cell."""
    by_cell: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for run in runs:
        by_cell.setdefault((run["mode"], run["concurrency"]), {})[run["layout"]] = run
    comparisons = []
    for (mode, concurrency), cell in by_cell.items():
        bare = cell.get("bare")
        for run in cell.values():
            if bare is not None:
                run["p50_vs_bare"] = _ratio(run["p50_ms"], bare["p50_ms"])
                run["p99_vs_bare"] = _ratio(run["p99_ms"], bare["p99_ms"])
                run["rps_vs_bare"] = _ratio(run["rps"], bare["rps"])
                by_round = round_ratios(run.get("round_rps", ()), bare.get("round_rps", ()))
                if by_round:
                    run["rps_vs_bare_by_round"] = by_round
                # What the middleware layer costs per request, in the terms: the time
                # per request at this concurrency beyond the bare model's (and its CPU).
                if run["rps"] and bare["rps"]:
                    run["middleware_us_per_request"] = round(1e6 * (1 / run["rps"] - 1 / bare["rps"]), 1)
                if run.get("cpu_ms_per_request") is not None and bare.get("cpu_ms_per_request") is not None:
                    run["middleware_cpu_us_per_request"] = round(
                        1000 * (run["cpu_ms_per_request"] - bare["cpu_ms_per_request"]), 1)
        layered, collapsed = cell.get("layered"), cell.get("collapsed")
        if layered is not None and collapsed is not None:
            comparisons.append({
                "mode": mode, "concurrency": concurrency,
                "layered_over_collapsed_p50": _ratio(layered["p50_ms"], collapsed["p50_ms"]),
                "layered_over_collapsed_p99": _ratio(layered["p99_ms"], collapsed["p99_ms"]),
                "collapsed_over_layered_rps": _ratio(collapsed["rps"], layered["rps"]),
            })
    return comparisons


def http_vs_grpc(runs: Sequence[Mapping[str, Any]], http_layouts: Mapping[str, str]) -> list[dict[str, Any]]:
    """Per cell and layout: its HTTP API against its gRPC API (same server process, same
    prompts, turns next to each other): p50, p99 and throughput ratios, and what the HTTP
    path costs the server per request — its whole CPU beyond the gRPC path's, and the HTTP
    event loop's own share (parsing, JSON, SSE)."""
    cells: dict[tuple[str, int], dict[str, Mapping[str, Any]]] = {}
    for run in runs:
        cells.setdefault((run["mode"], run["concurrency"]), {})[run["layout"]] = run
    out = []
    for (mode, concurrency), cell in cells.items():
        for http_layout, layout in http_layouts.items():
            http, grpc = cell.get(http_layout), cell.get(layout)
            if http is None or grpc is None:
                continue
            row: dict[str, Any] = {
                "mode": mode, "concurrency": concurrency, "layout": layout,
                "http_over_grpc_p50": _ratio(http["p50_ms"], grpc["p50_ms"]),
                "http_over_grpc_p99": _ratio(http["p99_ms"], grpc["p99_ms"]),
                "http_over_grpc_rps": _ratio(http["rps"], grpc["rps"]),
            }
            if mode == "stream":
                row["http_over_grpc_ttft_p50"] = _ratio(http["ttft_p50_ms"], grpc["ttft_p50_ms"])
            if http.get("cpu_ms_per_request") is not None and grpc.get("cpu_ms_per_request") is not None:
                row["http_extra_cpu_us_per_request"] = round(
                    1000 * (http["cpu_ms_per_request"] - grpc["cpu_ms_per_request"]), 1)
            row["http_loop_cpu_us_per_request"] = http.get("cpu_us_per_request_by_thread", {}).get("http-loop")
            out.append(row)
    return out


def batching_gain(runs: Sequence[Mapping[str, Any]], unbatched_layout: str = "collapsed-unbatched", *,
                  batched_layout: str = "collapsed") -> list[dict[str, Any]]:
    """Per cell: a batched layout against the same layout with a batcher off — the spine
    against `collapsed-unbatched` (nothing batched, the model step included) by default, or
    `collapsed-middleware-unbatched` (only the middleware batcher off); `layered-batched`
    against `layered` (the layered gateway batching each hop over the wire, or not)."""
    by_cell: dict[tuple[str, int], dict[str, Mapping[str, Any]]] = {}
    for run in runs:
        by_cell.setdefault((run["mode"], run["concurrency"]), {})[run["layout"]] = run
    out = []
    for (mode, concurrency), cell in by_cell.items():
        batched, unbatched = cell.get(batched_layout), cell.get(unbatched_layout)
        if batched is not None and unbatched is not None:
            out.append({"mode": mode, "concurrency": concurrency,
                        "batched_over_unbatched_rps": _ratio(batched["rps"], unbatched["rps"]),
                        "batched_over_unbatched_p50": _ratio(batched["p50_ms"], unbatched["p50_ms"]),
                        "batched_over_unbatched_p99": _ratio(batched["p99_ms"], unbatched["p99_ms"])})
    return out


def machine_info() -> dict[str, Any]:
    """Enough about the machine to tell whether two results files are comparable."""

    def version(package: str) -> str | None:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "cpu_count": os.cpu_count(), "physical_cores": psutil.cpu_count(logical=False),
        "spine_cpu": os.environ.get(CPU_PLACEMENT_ENV) or server_cpu() or "not placed (one CPU)",
        "memory_gb": round(psutil.virtual_memory().total / (1024 ** 3), 1),
        "torch": version("torch"), "grpcio": version("grpcio"), "python": sys.version.split()[0],
        "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
        "torch_threads_per_process": int(os.environ.get("SPINE_TORCH_THREADS", "1")),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "nan" if value != value else f"{value:.{digits}f}"
    return str(value)


def _print_ratios(console: Console, rows: list[dict[str, Any]] | None, title: str, ratios: dict[str, str]) -> None:
    """One row per (mode, concurrency) cell; `ratios` maps a column heading to its key."""
    if not rows:
        return
    table = Table(title=title)
    for column in ("mode", "conc", *ratios):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(row["mode"], str(row["concurrency"]), *(_fmt(row.get(key)) for key in ratios.values()))
    console.print(table)


THREAD_CPU_LAYOUTS = ("bare", "collapsed")


def thread_cpu_rows(unary: Sequence[Mapping[str, Any]]) -> list[tuple[int, str, dict[str, float]]]:
    """Per concurrency: bare's and the spine's server CPU per request by thread group, and
    their difference (`collapsed − bare`): where the middleware layer's CPU goes."""
    rows: list[tuple[int, str, dict[str, float]]] = []
    for concurrency in sorted({run["concurrency"] for run in unary}):
        cell: dict[str, Mapping[str, float]] = {
            run["layout"]: run["cpu_us_per_request_by_thread"] for run in unary
            if run["concurrency"] == concurrency and run.get("cpu_us_per_request_by_thread")}
        found = [(layout, cell[layout]) for layout in THREAD_CPU_LAYOUTS if layout in cell]
        rows += [(concurrency, layout, dict(groups)) for layout, groups in found]
        if len(found) == 2:
            (_, bare), (spine, spine_groups) = found
            rows.append((concurrency, f"{spine} − bare",
                         {group: round(spine_groups[group] - bare.get(group, 0.0), 1) for group in spine_groups}))
    return rows


def _print_thread_cpu(console: Console, unary: Sequence[Mapping[str, Any]]) -> None:
    rows = thread_cpu_rows(unary)
    if not rows:
        return
    groups = list(rows[0][2])
    table = Table(title="server CPU µs per request by thread (unary; handlers: the gRPC pool, where "
                        "the gateway and admission run; model: the decode loop)")
    for column in ("conc", "layout", *groups, "total", "model steps/req", "seqs/step"):
        table.add_column(column, justify="left" if column == "layout" else "right")
    runs = {(run["concurrency"], run["layout"]): run for run in unary}
    for concurrency, layout, spent in rows:
        run = runs.get((concurrency, layout), {})
        table.add_row(str(concurrency), layout, *(_fmt(spent.get(group), 0) for group in groups),
                      _fmt(sum(spent.values()), 0), _fmt(run.get("model_steps_per_request"), 3),
                      _fmt(run.get("model_batch_mean"), 1))
    console.print(table)
    console.print("  seqs/step: sequences per model step (`spine_batch_size`). Fewer than bare's: the layout "
                  "leaves KV slots empty (slower to hand requests over) and each step's fixed cost falls on "
                  "fewer requests; the same with more model CPU per request: the same steps cost more")


def print_tables(results: Mapping[str, Any], console: Console) -> None:
    runs = results["runs"]
    unary = [r for r in runs if r["mode"] == "unary"]
    table = Table(title=f"unary Generate, max_tokens={results['settings']['max_tokens']} (ratios: layout / bare)")
    for column in ("conc", "layout", "reqs", "err", "p50 ms", "p99 ms", "rps", "p50 ×bare", "p99 ×bare",
                   "rps ×bare", "rounds' rps ×bare (mid half)", "µs/req over bare", "CPU µs/req over bare", "peak RSS MB"):
        table.add_column(column, justify="left" if column == "layout" else "right")
    for run in unary:
        table.add_row(str(run["concurrency"]), run["layout"], str(run["requests"]), str(run["errors"]),
                      _fmt(run["p50_ms"]), _fmt(run["p99_ms"]), _fmt(run["rps"], 1), _fmt(run.get("p50_vs_bare")),
                      _fmt(run.get("p99_vs_bare")), _fmt(run.get("rps_vs_bare")),
                      spread(run.get("rps_vs_bare_by_round")) if run["layout"] != "bare" else "",
                      _fmt(run.get("middleware_us_per_request"), 0), _fmt(run.get("middleware_cpu_us_per_request"), 0),
                      _fmt(run["peak_rss_mb"], 0))
    console.print(table)
    _print_thread_cpu(console, unary)
    stream = [r for r in runs if r["mode"] == "stream"]
    if stream:
        table = Table(title="GenerateStream: time to first token and inter-token latency (ratios: layout / bare)")
        for column in ("conc", "layout", "reqs", "err", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99",
                       "total p50", "total p99", "p50 ×bare", "peak RSS MB"):
            table.add_column(column, justify="left" if column == "layout" else "right")
        for run in stream:
            table.add_row(str(run["concurrency"]), run["layout"], str(run["requests"]), str(run["errors"]),
                          _fmt(run["ttft_p50_ms"]), _fmt(run["ttft_p99_ms"]), _fmt(run["itl_p50_ms"]),
                          _fmt(run["itl_p99_ms"]), _fmt(run["p50_ms"]), _fmt(run["p99_ms"]),
                          _fmt(run.get("p50_vs_bare")), _fmt(run["peak_rss_mb"], 0))
        console.print(table)
    _print_ratios(console, results.get("layered_vs_collapsed"), "layered vs collapsed (same cell)", {
        "p50 layered/collapsed": "layered_over_collapsed_p50", "p99 layered/collapsed": "layered_over_collapsed_p99",
        "rps collapsed/layered": "collapsed_over_layered_rps"})
    _print_ratios(console, results.get("http_vs_grpc"), "HTTP API vs gRPC, same layout and server "
                  "(http extra CPU: the server's CPU µs per request beyond the gRPC path's; loop: the HTTP event "
                  "loop's own)", {
                      "layout": "layout", "p50 http/grpc": "http_over_grpc_p50", "p99 http/grpc": "http_over_grpc_p99",
                      "rps http/grpc": "http_over_grpc_rps", "TTFT http/grpc": "http_over_grpc_ttft_p50",
                      "http extra CPU µs/req": "http_extra_cpu_us_per_request",
                      "loop CPU µs/req": "http_loop_cpu_us_per_request"})
    gain_columns = {"rps batched/unbatched": "batched_over_unbatched_rps",
                    "p50 batched/unbatched": "batched_over_unbatched_p50",
                    "p99 batched/unbatched": "batched_over_unbatched_p99"}
    _print_ratios(console, results.get("batched_vs_unbatched"),
                  "batched vs unbatched collapsed spine: batcher off end to end, model step included (same cell)",
                  gain_columns)
    _print_ratios(console, results.get("batched_vs_middleware_unbatched"),
                  "batched vs collapsed-middleware-unbatched: only the middleware batcher off (same cell)",
                  gain_columns)
    _print_ratios(console, results.get("layered_batched_vs_layered"),
                  "layered-batched vs layered: the layered gateway batching each hop over the wire (same cell)",
                  gain_columns)
    machine = results["machine"]
    console.print(f"machine: {machine['cpu_count']} CPUs, torch {machine['torch']}, load average "
                  f"{machine['loadavg_start']} at start, {machine.get('loadavg_end')} at end "
                  "(a busy machine makes every number noisy; compare ratios within one run); "
                  f"model processes of bare and the collapsed layouts on CPU {machine.get('spine_cpu')}, "
                  "the load generator on the others, the layered stack's processes placed by the OS")
