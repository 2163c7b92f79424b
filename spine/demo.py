"""The main job (`make run`): both layouts, one workload, a side-by-side table."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.table import Table

from spine.config import placements_for
from spine.runtime import Stack
from spine.stats import Summary
from spine.workload import mixed_workload, run_workload


def run_layouts_side_by_side(config: Mapping[str, Any], layouts: tuple[str, ...] = ("layered", "collapsed"),
                             count: int = 120, concurrency: int = 4, console: Console | None = None) -> int:
    from spine.cli import dev_api_key

    console = console or Console()
    key = dev_api_key(config) or ""
    items = mixed_workload(count, key)
    summaries: dict[str, Summary] = {}
    decisions: dict[str, list[Any]] = {}
    for layout in layouts:
        with console.status(f"starting the {layout} layout"):
            stack = Stack(config, placements_for(layout, config))
            stack.start()
        try:
            started = time.perf_counter()
            results = run_workload(stack.address, items, concurrency=concurrency, time_limit_s=60)
            wall = time.perf_counter() - started
            done = [r for r in results if r is not None]
            summaries[layout] = Summary.of([r.latency_s for r in done], [r.code.name for r in done], wall)
            decisions[layout] = [r.decision() if r else None for r in results]
        finally:
            stack.stop()
    table = Table(title=f"{count} mixed requests at concurrency {concurrency}, per layout")
    table.add_column("metric")
    for layout in layouts:
        table.add_column(layout, justify="right")
    rows = [("p50 ms", "p50_ms"), ("p90 ms", "p90_ms"), ("p99 ms", "p99_ms"), ("requests/s", "rps"),
            ("OK", "ok"), ("requests", "count")]
    for label, attr in rows:
        table.add_row(label, *[f"{getattr(summaries[layout], attr):.2f}" for layout in layouts])
    codes = sorted({code for s in summaries.values() for code in s.statuses})
    for code in codes:
        table.add_row(f"status {code}", *[str(summaries[layout].statuses.get(code, 0)) for layout in layouts])
    console.print(table)
    base = layouts[0]
    for layout in layouts[1:]:
        same = sum(1 for a, b in zip(decisions[base], decisions[layout], strict=True) if a == b)
        console.print(f"decision parity {base} vs {layout}: {same}/{len(items)} identical "
                      f"(status, cache hit, tokens)")
        ratio = summaries[layout].p50_ms / summaries[base].p50_ms
        console.print(f"p50 latency {layout}/{base}: {ratio:.2f}x")
    return 0


def run_demo(config: Mapping[str, Any]) -> int:
    """The main job: the staged migration demo (the side-by-side table is `spine ab`'s)."""
    from spine.migration_demo import run_migration_demo

    return run_migration_demo(config)
