"""What an A/B run found: one dict, written as JSON, Markdown with PNG plots, and a table.

Throughput: in a closed-loop run every layout is driven by the same workers in turn, so
wall-clock throughput would be the same for all; the figure reported is what the layout
sustains at that concurrency (Little's law: concurrency / mean latency). In an open-loop
run every layout is offered the same rate; throughput is completed requests per second
and the difference shows in latency, counted from the scheduled arrival.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from runtime.observability.stats import percentile
from runtime.observability.tracing import ROOT_SPAN
from runtime.shadow.decisions import FIELDS, decide, differing
from spine.client.gateway_client import CallResult
from spine.tools.ab.interleave import ABRun, LayoutRun
from spine.tools.ab.verdict import layout_verdicts, verdict_lines
from spine.tools.workload.generator import Entry

MODEL_SPAN = "inference.generate"
# Stacking order of the per-middleware bar: the pipeline's order.
SPAN_ORDER = ("auth.check", "router.resolve", "ratelimit.admit", "cache.lookup", MODEL_SPAN,
              "cache.store", "metrics.record", "logs.append")
MAX_EXAMPLES = 5


def build_report(ab: ABRun, entries: Sequence[Entry], workload: Mapping[str, Any]) -> dict[str, Any]:
    layouts = {run.name: _layout_report(run, ab) for run in ab.runs}
    up = [run for run in ab.runs if run.status == "up"]
    parity: dict[str, Any] = {}
    if len(up) >= 2:
        base = up[0]
        parity = {"base": base.name, "vs": {run.name: _parity(base, run, entries) for run in up[1:]}}
    return {
        "workload": dict(workload),
        "options": {"mode": ab.options.mode, "concurrency": ab.options.concurrency,
                    "time_limit_s": ab.options.time_limit_s, "timeout_s": ab.options.timeout_s},
        "wall_s": ab.wall_s,
        "layouts": layouts,
        "parity": parity,
        "verdict": layout_verdicts(ab),
    }


def _latencies(run: LayoutRun, mode: str) -> list[float]:
    values = run.scheduled_latency_s if mode == "open" else [r.latency_s if r else None for r in run.results]
    return [v for v in values if v is not None]


def _layout_report(run: LayoutRun, ab: ABRun) -> dict[str, Any]:
    if run.status != "up":
        return {"status": run.status, "error": run.error}
    done = [r for r in run.results if r is not None]
    latencies_ms = [v * 1000.0 for v in _latencies(run, ab.options.mode)]
    statuses = Counter(r.code.name for r in done)
    if ab.options.mode == "closed":
        mean_s = sum(latencies_ms) / len(latencies_ms) / 1000.0 if latencies_ms else 0.0
        rps = ab.options.concurrency / mean_s if mean_s > 0 else 0.0
    else:
        rps = len(done) / ab.wall_s if ab.wall_s > 0 else 0.0
    roots = int((run.spans.get(ROOT_SPAN) or {}).get("count", 0))
    middleware_ms = {}
    if roots:
        names = [n for n in SPAN_ORDER if n in run.spans] + sorted(
            n for n in run.spans if n not in SPAN_ORDER and n != ROOT_SPAN)
        middleware_ms = {name: run.spans[name]["total_s"] / roots * 1000.0 for name in names}
    return {
        "status": "up", "address": run.address, "requests": len(done), "not_sent": len(run.results) - len(done),
        "not_serving": run.not_serving,
        "ok": statuses.get("OK", 0), "errors_by_status": {k: v for k, v in sorted(statuses.items()) if k != "OK"},
        "latency_ms": {"p50": percentile(latencies_ms, 50), "p90": percentile(latencies_ms, 90),
                       "p99": percentile(latencies_ms, 99), "p99.9": percentile(latencies_ms, 99.9),
                       "mean": sum(latencies_ms) / len(latencies_ms) if latencies_ms else math.nan},
        "throughput_rps": rps,
        "cpu_s": run.cpu_s,
        "cpu_ms_per_request": run.cpu_s / len(done) * 1000.0 if run.cpu_s is not None and done else None,
        "peak_rss_bytes": run.peak_rss_bytes,
        "device_bytes": run.device_bytes,
        "traced_requests": roots,
        "middleware_ms_per_request": middleware_ms,
        "span_counts": {name: int(stat.get("count", 0)) for name, stat in run.spans.items()},
        "stream": stream_timing(done),
        "latencies_ms": latencies_ms,
    }


def stream_timing(results: Sequence[CallResult]) -> dict[str, Any] | None:
    """Streams as their client saw them: time to the first chunk, and the time per chunk
    after it (median over streams of (end of the call - first chunk) / (chunks - 1)); None
    without a stream.

    Why the second: it is the decode loop's speed (one chunk a step) and nothing else. The
    model's span (`inference.generate`) also counts the time a request waited for a KV slot,
    which in a closed loop is longer on the side that keeps more requests in the model (the
    spine, whose middleware hops hold none), so it cannot say on its own whether the model
    kept its speed inside the spine; this can."""
    streams = [(r, first) for r in results  # answered by the model: a cache hit is one chunk, no step
               if r.ok and (first := r.first_chunk_s) is not None and r.chunks and not r.chunks[0].cached]
    if not streams:
        return None
    first_ms = [first * 1000.0 for _, first in streams]
    per_chunk_ms = [(r.latency_s - first) * 1000.0 / (len(r.chunks) - 1) for r, first in streams if len(r.chunks) >= 2]
    return {"count": len(streams), "ttft_ms_p50": percentile(first_ms, 50),
            "ms_per_chunk_p50": percentile(per_chunk_ms, 50) if per_chunk_ms else None}


def _parity(base: LayoutRun, other: LayoutRun, entries: Sequence[Entry]) -> dict[str, Any]:
    agree: Counter[str] = Counter()
    compared = identical = 0
    examples: list[dict[str, Any]] = []
    for index, (a, b) in enumerate(zip(base.results, other.results, strict=True)):
        if a is None or b is None:
            continue
        request = entries[index].item.request
        da, db = _decision(request, a), _decision(request, b)
        fields = differing(da, db)
        compared += 1
        identical += not fields
        agree.update(name for name in FIELDS if name not in fields)
        if fields and len(examples) < MAX_EXAMPLES:
            examples.append({"index": index, "fields": list(fields),
                             base.name: _brief(da.as_dict(), fields), other.name: _brief(db.as_dict(), fields)})
    return {"compared": compared, "identical": identical, "agree": {name: agree.get(name, 0) for name in FIELDS},
            "examples": examples}


def _decision(request: Any, result: CallResult) -> Any:
    return decide(request, result.code, result.details, result.response, result.chunks)


def _brief(decision: Mapping[str, Any], fields: Sequence[str]) -> dict[str, Any]:
    brief = {}
    for name in fields:
        value = decision[name]
        if isinstance(value, list) and len(value) > 12:
            value = [*value[:12], "…"]
        brief[name] = value
    return brief


# -- outputs ----------------------------------------------------------------------------------
def write_json(report: Mapping[str, Any], path: Path) -> None:
    path.write_text(json.dumps(report, indent=2, default=_jsonable, allow_nan=True) + "\n")


def _jsonable(value: Any) -> Any:
    return str(value)


def up_layouts(report: Mapping[str, Any]) -> list[str]:
    return [name for name, data in report["layouts"].items() if data["status"] == "up"]


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return "—" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def _mib(value: int | None) -> str:
    return "—" if value is None else f"{value / (1 << 20):.1f}"


def metric_rows(report: Mapping[str, Any]) -> list[tuple[str, list[str]]]:
    """(label, one cell per layout that was up) — shared by the table and the Markdown."""
    names = up_layouts(report)
    data = [report["layouts"][n] for n in names]
    rows: list[tuple[str, list[str]]] = []
    for key in ("p50", "p90", "p99", "p99.9"):
        rows.append((f"{key} latency ms", [_fmt(d["latency_ms"][key]) for d in data]))
    rows.append(("throughput req/s", [_fmt(d["throughput_rps"], 1) for d in data]))
    rows.append(("requests (OK)", [f"{d['requests']} ({d['ok']})" for d in data]))
    statuses = sorted({code for d in data for code in d["errors_by_status"]})
    for code in statuses:
        rows.append((f"status {code}", [str(d["errors_by_status"].get(code, 0)) for d in data]))
    if any(d["not_sent"] - d.get("not_serving", 0) for d in data):
        rows.append(("not sent (time limit)", [str(d["not_sent"] - d.get("not_serving", 0)) for d in data]))
    if any(d.get("not_serving", 0) for d in data):
        rows.append(("not sent (not SERVING)", [str(d.get("not_serving", 0)) for d in data]))
    rows.append(("CPU ms / request (tree)", [_fmt(d["cpu_ms_per_request"]) for d in data]))
    rows.append(("peak RSS MiB (tree)", [_mib(d["peak_rss_bytes"]) for d in data]))
    if any(d["device_bytes"] is not None for d in data):
        rows.append(("device memory MiB", [_mib(d["device_bytes"]) for d in data]))
    spans = [n for n in SPAN_ORDER if any(n in d["middleware_ms_per_request"] for d in data)]
    for name in spans:
        rows.append((f"{name} ms", [_fmt(d["middleware_ms_per_request"].get(name), 3) for d in data]))
    if MODEL_SPAN in spans:
        # Little's law: the model's span includes its queue, which is longer where fewer
        # requests wait in middleware hops (under load the layered stack holds many of its
        # requests in its hops, the spine few): read the span beside this count.
        rows.append(("mean requests in the model", [_fmt(_in_model(d), 1) for d in data]))
    if any(d.get("stream") for d in data):
        # The decode loop's own speed, queue left out (see `stream_timing`).
        rows.append(("stream TTFT p50 ms", [_fmt((d.get("stream") or {}).get("ttft_ms_p50")) for d in data]))
        rows.append(("stream ms per chunk after the first p50",
                     [_fmt((d.get("stream") or {}).get("ms_per_chunk_p50"), 3) for d in data]))
    return rows


def _in_model(layout: Mapping[str, Any]) -> float | None:
    """Requests inside the model's span on average: its time per request × throughput."""
    span_ms = layout["middleware_ms_per_request"].get(MODEL_SPAN)
    return None if span_ms is None else span_ms / 1000.0 * layout["throughput_rps"]


def parity_lines(report: Mapping[str, Any]) -> list[str]:
    parity = report.get("parity") or {}
    lines = []
    for name, result in (parity.get("vs") or {}).items():
        compared = result["compared"]
        fields = ", ".join(f"{field} {count}/{compared}" for field, count in result["agree"].items())
        lines.append(f"decision parity {parity['base']} vs {name}: {result['identical']}/{compared} identical "
                     f"({fields})")
    return lines


def table(report: Mapping[str, Any]) -> Table:
    names = up_layouts(report)
    options = report["options"]
    title = (f"{report['workload'].get('count', '?')} requests, {options['mode']} loop"
             + (f" at concurrency {options['concurrency']}" if options["mode"] == "closed" else ""))
    result = Table(title=title)
    result.add_column("metric")
    for name in names:
        result.add_column(name, justify="right")
    for label, cells in metric_rows(report):
        result.add_row(label, *cells)
    return result


def down_lines(report: Mapping[str, Any]) -> list[str]:
    return [f"{name} is DOWN: {data['error']}" for name, data in report["layouts"].items() if data["status"] != "up"]


def write_plots(report: Mapping[str, Any], out_dir: Path) -> list[Path]:
    """Latency CDFs on one chart, and a stacked bar of time per middleware."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = up_layouts(report)
    written: list[Path] = []
    if not names:
        return written
    figure, axes = plt.subplots(figsize=(8, 4.5), dpi=110)
    for name in names:
        values = sorted(report["layouts"][name]["latencies_ms"])
        if values:
            fractions = [(i + 1) / len(values) for i in range(len(values))]
            p50, p99 = report["layouts"][name]["latency_ms"]["p50"], report["layouts"][name]["latency_ms"]["p99"]
            axes.step(values, fractions, where="post", linewidth=1.8,
                      label=f"{name} (p50 {p50:.1f} ms, p99 {p99:.1f} ms)")
    axes.set_xscale("log")
    axes.set_xlabel("latency (ms, log scale)")
    axes.set_ylabel("fraction of requests")
    axes.set_ylim(0, 1.01)
    axes.grid(True, which="both", alpha=0.3)
    axes.set_title("Latency CDF per layout (same workload, interleaved)")
    axes.legend(loc="lower right")
    figure.tight_layout()
    path = out_dir / "latency_cdf.png"
    figure.savefig(path)
    plt.close(figure)
    written.append(path)

    spans = [n for n in SPAN_ORDER if any(n in report["layouts"][x]["middleware_ms_per_request"] for x in names)]
    if spans:
        figure, axes = plt.subplots(figsize=(8, 4.5), dpi=110)
        bottoms = [0.0] * len(names)
        colours = plt.get_cmap("tab10")
        for position, span in enumerate(spans):
            heights = [report["layouts"][x]["middleware_ms_per_request"].get(span, 0.0) for x in names]
            axes.bar(names, heights, bottom=bottoms, label=span, color=colours(position % 10), width=0.55)
            bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
        for index, total in enumerate(bottoms):
            axes.annotate(f"{total:.2f} ms", (index, total), ha="center", va="bottom", fontsize=9)
        axes.set_ylabel("ms per request (mean over traced requests)")
        axes.set_title("Time per middleware, as the gateway sees it (spans)")
        axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)
        axes.grid(True, axis="y", alpha=0.3)
        figure.tight_layout()
        path = out_dir / "middleware_time.png"
        figure.savefig(path)
        plt.close(figure)
        written.append(path)
    return written


def write_markdown(report: Mapping[str, Any], out_dir: Path, plots: Sequence[Path] = ()) -> Path:
    names = up_layouts(report)
    workload = report["workload"]
    options = report["options"]
    lines = ["# spine ab: the same workload through each layout", ""]
    source = workload.get("trace") or "synthetic"
    lines.append(f"Workload: {workload.get('count', '?')} requests ({source}), {options['mode']} loop"
                 + (f" at concurrency {options['concurrency']}" if options["mode"] == "closed"
                    else f", arrivals as scheduled (mean {workload.get('rate', '?')}/s)")
                 + f"; time limit {options['time_limit_s']:g}s, per-request timeout {options['timeout_s']:g}s; "
                 f"ran {report['wall_s']:.1f}s. "
                 + ("Each layout runs alone in turn, a round of requests at a time, the order rotating."
                    if options["mode"] == "closed" else "Each request goes to every layout at once."))
    lines.append("")
    for line in down_lines(report):
        lines += [f"**{line}**", ""]
    if names:
        lines.append("| metric | " + " | ".join(names) + " |")
        lines.append("|---|" + "---:|" * len(names))
        for label, cells in metric_rows(report):
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
        lines.append("CPU and memory are per process tree (a layout's gateway and its component processes). "
                     "Middleware times come from spans with the same names in every layout, measured at the "
                     "gateway (a remote call's time includes its hop).")
        lines.append("")
    verdict = verdict_lines(report)
    if verdict:
        lines += ["## Verdict", "", "Each layout against the first, as a migration stage's judge would score it: "
                  "the Hodges-Lehmann shift of the OK requests' latency with its confidence interval "
                  "(Mann-Whitney U), layout errors by Fisher's exact test.", "", "```", *verdict, "```", ""]
    parity = parity_lines(report)
    if parity:
        lines += ["## Decision parity", ""] + [f"- {line}" for line in parity] + [""]
        for name, result in report["parity"]["vs"].items():
            for example in result["examples"]:
                lines.append(f"  - request {example['index']} ({name}): differs in {', '.join(example['fields'])}: "
                             f"{report['parity']['base']} {example[report['parity']['base']]}, "
                             f"{name} {example[name]}")
        lines.append("")
    if plots:
        lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path
