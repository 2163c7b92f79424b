"""`python -m bench.caller_hops`: the caller's side of remote middleware calls, three ways."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.caller_hops import PATHS, main


def test_a_short_run_measures_every_path_at_every_concurrency(tmp_path: Path) -> None:
    out = tmp_path / "hops.json"
    # Enough calls per turn that the child's CPU, read in clock ticks (10 ms), is never 0.
    assert main(["--hops", "2", "--requests", "150", "--rounds", "1", "--concurrency", "1,3", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["hops"] == 2
    assert set(figures["cells"]) == {"c=1", "c=3"}
    for cell in figures["cells"].values():
        assert set(cell) == set(PATHS)
        for path in cell.values():
            assert path["rps"] > 0 and path["p99_us"] >= path["p50_us"] > 0
            assert path["caller_cpu_us"] > 0 and path["child_cpu_us"] > 0  # both sides did the calls


@pytest.mark.parametrize("argv", [["--hops", "0"], ["--concurrency", "0"], ["--concurrency", "a,b"]])
def test_bad_arguments_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
