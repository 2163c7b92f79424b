"""`python -m bench.variants`: one setting's values side by side against bare, in one run."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bench.variants import main, overlay_for, parse_vary, tree_variants, variant_configs

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_a_setting_and_its_values_are_parsed_as_yaml_scalars() -> None:
    assert parse_vary("batching.max_wait_us=0, 10000") == ("batching.max_wait_us", [0, 10000])
    assert parse_vary("batching.enabled=true,false") == ("batching.enabled", [True, False])
    assert overlay_for("inference.max_batch", 4) == {"inference": {"max_batch": 4}}


@pytest.mark.parametrize("spec", ["max_wait_us=0", "batching.max_wait_us", "batching.max_wait_us=", "=1,2"])
def test_a_malformed_vary_is_refused_with_an_example(spec: str) -> None:
    with pytest.raises(ValueError, match=r"section\.key=value1,value2"):
        parse_vary(spec)


def test_each_variant_is_the_bench_overlay_plus_the_one_setting(tmp_path: Path) -> None:
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({"ratelimit": {"default": {"burst": 100000}}}))
    configs = variant_configs(tmp_path, base, "batching.max_wait_us", [0, 2500])
    assert list(configs) == ["batching.max_wait_us=0", "batching.max_wait_us=2500"]
    second = yaml.safe_load(configs["batching.max_wait_us=2500"].read_text())
    assert second == {"ratelimit": {"default": {"burst": 100000}}, "batching": {"max_wait_us": 2500}}


def test_a_value_the_config_refuses_is_one_line_before_any_server_starts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--vary", "batching.max_wait_us=-5"]) == 2
    assert "batching.max_wait_us" in capsys.readouterr().out


def test_a_short_run_prints_each_variant_against_bare() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "bench.variants", "--vary", "batching.max_wait_us=0,5000", "--concurrency", "2",
         "--requests", "6", "--rounds", "1"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert completed.returncode == 0, completed.stderr[-2000:]
    rows = [line for line in completed.stdout.splitlines() if line.startswith("│ unary")]
    assert len(rows) == 3, completed.stdout
    assert any("batching.max_wait_us=5000" in row for row in rows)
    assert "1.000" in rows[0]  # bare against itself


def _checkout_copy(where: Path) -> Path:
    """The packages a spine server imports, copied as a checkout without build outputs."""
    for package in ("spine", "runtime", "migration", "services", "monolith", "protos"):
        shutil.copytree(REPO_ROOT / package, where / package, ignore=shutil.ignore_patterns("__pycache__"))
    # wire/v1 is generated, not in git: the tree makes its own
    return where


def test_a_tree_that_is_not_a_checkout_or_is_this_one_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a checkout of spine"):
        tree_variants([str(tmp_path)])
    with pytest.raises(ValueError, match="this checkout itself"):
        tree_variants([str(REPO_ROOT)])


def test_a_tree_runs_its_own_code_beside_this_checkout(tmp_path: Path) -> None:
    tree = _checkout_copy(tmp_path / "change")
    command = [sys.executable, "-m", "bench.variants", "--tree", str(tree), "--concurrency", "2",
               "--requests", "6", "--rounds", "1"]
    completed = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert completed.returncode == 0, completed.stderr[-2000:]
    rows = [line.split("│")[3].strip() for line in completed.stdout.splitlines() if line.startswith("│ unary")]
    assert rows == ["bare", "collapsed", "tree:change"], completed.stdout
    assert (tree / "wire" / "v1" / "generation_pb2.py").is_file()  # made from the tree's own protos

    # Its code, not this checkout's: a tree that cannot import its router does not start.
    with (tree / "services" / "router" / "service.py").open("a") as router:
        router.write("\nthis is not python(\n")
    broken = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert broken.returncode == 1
    assert "tree:change" in broken.stdout and f"{tree}/services/router/service.py" in broken.stdout, broken.stdout


def test_a_short_run_of_the_layered_layout_over_http() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "bench.variants", "--vary", "batching.max_wait_us=0", "--layout", "layered", "--http",
         "--concurrency", "2", "--requests", "6", "--rounds", "1"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert "variants of the layered layout" in completed.stdout
    rows = [line.split("│")[3].strip() for line in completed.stdout.splitlines() if line.startswith("│ unary")]
    assert rows == ["bare", "batching.max_wait_us=0"], completed.stdout
