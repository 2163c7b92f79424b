"""The main job (`make run`), and the side-by-side table (`spine ab`'s, kept for callers)."""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.console import Console


def run_layouts_side_by_side(config: Mapping[str, Any], layouts: tuple[str, ...] = ("layered", "collapsed"),
                             count: int = 120, concurrency: int = 4, console: Console | None = None,
                             out_dir: Path | None = None) -> int:
    """One synthetic workload through `layouts`, interleaved; prints the table (see `spine.tools.ab`)."""
    from spine.tools.ab.command import run_command
    from spine.tools.ab.runner import RunOptions
    from spine.tools.ab.workload import SyntheticSpec

    with tempfile.TemporaryDirectory(prefix="spine-ab-report-") as tmp:
        return run_command(config, layouts=list(layouts), out_dir=out_dir or Path(tmp),
                           spec=SyntheticSpec(count=count), options=RunOptions(concurrency=concurrency),
                           plots=out_dir is not None, console=console)


def run_demo(config: Mapping[str, Any]) -> int:
    """The main job: the staged migration demo (the side-by-side table is `spine ab`'s)."""
    from spine.tools.migration_demo import run_migration_demo

    return run_migration_demo(config)
