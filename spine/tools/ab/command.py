"""`spine ab`: build or load the workload, run it through the layouts, write the report."""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from runtime.config.model import SpineConfig
from spine.client.gateway_client import CallResult
from spine.tools.ab.interleave import RunOptions, run_ab
from spine.tools.ab.report import (
    build_report,
    down_lines,
    parity_lines,
    table,
    write_json,
    write_markdown,
    write_plots,
)
from spine.tools.ab.verdict import verdict_lines
from spine.tools.workload.generator import Entry, SyntheticSpec, synthetic, tenant_keys
from spine.tools.workload.recorded import read_trace, write_trace


def run_command(config: SpineConfig, *, layouts: Sequence[str], out_dir: Path,
                spec: SyntheticSpec | None = None, trace: Path | None = None, record: Path | None = None,
                targets: Mapping[str, str] | None = None, options: RunOptions | None = None,
                trace_ratio: float = 1.0, plots: bool = True, console: Console | None = None) -> int:
    """0 when every layout was up; 1 when one was down (the report says which and why)."""
    console = console or Console()
    options = options or RunOptions()
    keys = tenant_keys(config.auth)
    if trace is not None:
        entries = read_trace(trace)
        workload: dict[str, Any] = {"trace": str(trace), "count": len(entries)}
    else:
        spec = spec or SyntheticSpec()
        entries = synthetic(spec, keys)
        workload = {"synthetic": {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in asdict(spec).items()},
                    "count": len(entries), "rate": spec.rate}
    if record is not None:
        written = write_trace(record, entries)
        console.print(f"recorded {written} requests to {record}")
    out_dir.mkdir(parents=True, exist_ok=True)
    warm_token = next(iter(keys.values()), None)
    with tempfile.TemporaryDirectory(prefix="spine-ab-") as tmp, _progress(console) as progress:
        task = progress.add_task("starting", total=None)
        lock = threading.Lock()

        def on_status(message: str) -> None:
            progress.update(task, description=message)

        def on_result(layout: str, index: int, result: CallResult) -> None:
            with lock:
                progress.advance(task)

        def on_total(total: int) -> None:
            progress.update(task, total=total, completed=0)

        ab = run_ab(config, layouts, entries, Path(tmp), options=options, targets=targets, trace_ratio=trace_ratio,
                    warmup_token=warm_token, on_status=on_status, on_result=on_result, on_total=on_total)
    report = build_report(ab, entries, workload)
    write_json(report, out_dir / "ab.json")
    written_plots = write_plots(report, out_dir) if plots else []
    markdown = write_markdown(report, out_dir, written_plots)
    console.print(table(report))
    for line in verdict_lines(report) + parity_lines(report):
        console.print(line, markup=False)
    for line in down_lines(report):
        console.print(f"[bold red]{line}[/bold red]")
    console.print(f"report: {markdown}  json: {out_dir / 'ab.json'}"
                  + (f"  plots: {', '.join(p.name for p in written_plots)}" if written_plots else ""))
    return 1 if down_lines(report) else 0


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True)


__all__ = ["Entry", "run_command"]
