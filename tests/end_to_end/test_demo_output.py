"""What `make run` shows: the tables and the summary on the screen, every log line in the run
directory's log, and — in a terminal — the dashboard kept up after the runs.

The parts are checked in-process in a second or so; the whole demo, piped and in a terminal
(a pseudo-terminal), takes a minute or two each and is marked slow (`pytest -m slow`).
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from spine.tools.demo.migration import RUNS, RunReport, forget_secrets, summary
from spine.tools.demo.screen import DemoScreen, logs_in
from tests.waiting import eventually

REPO = Path(__file__).resolve().parents[2]
OUTCOMES = ["  1. healthy spine → promoted in ", "  2. failing spine → rolled back by the error_rate gate in ",
            "  3. spine answering differently → rolled back by the parity gate in "]


def test_log_lines_and_whatever_reaches_stderr_go_to_the_log_file_and_stderr_comes_back(tmp_path: Path) -> None:
    log = tmp_path / "run" / "demo.log"
    before = logging.getLogger().handlers[:]
    with logs_in(log):
        logging.getLogger("spine.shadow").debug("a mismatch, in full")
        logging.getLogger("spine.shadow").warning("3 shadow mismatches in the last second")
        logging.getLogger("urllib3").debug("a library's chatter stays out")
        os.write(2, b"what gRPC's core writes on fd 2\n")
        child = subprocess.run([sys.executable, "-c", "import sys; sys.stderr.write('a child inherits it\\n')"])
        assert child.returncode == 0
        print("and a thread's traceback", file=sys.stderr)
    text = log.read_text()
    for line in ("spine.shadow DEBUG a mismatch, in full", "spine.shadow WARNING 3 shadow mismatches",
                 "what gRPC's core writes on fd 2", "a child inherits it", "and a thread's traceback"):
        assert line in text
    assert "chatter" not in text
    assert logging.getLogger().handlers == before and logging.getLogger("spine").level == logging.NOTSET
    probe = subprocess.run([sys.executable, "-c", f"import os; print(os.readlink('/proc/{os.getpid()}/fd/2'))"],
                           capture_output=True, text=True)
    assert probe.stdout.strip() != str(log)  # fd 2 is what it was again


def test_without_a_terminal_the_screen_shows_no_status_line_and_keeps_nothing_open(tmp_path: Path) -> None:
    out = io.StringIO()
    screen = DemoScreen(Console(file=out, width=140))
    assert not screen.interactive
    with logs_in(tmp_path / "demo.log"):
        with screen.busy("starting"), screen.run_status("Run 1/3: healthy spine") as status:
            status.update("stage 1/4 observability-local: spine weight 10%")
        screen.say("dashboard: http://127.0.0.1:1/")
    assert out.getvalue() == "dashboard: http://127.0.0.1:1/\n"
    logged = (tmp_path / "demo.log").read_text()
    assert "[Run 1/3: healthy spine] stage 1/4 observability-local" in logged and "dashboard:" in logged


def test_the_summary_ends_with_one_line_per_outcome_and_says_where_the_mismatches_are(tmp_path: Path) -> None:
    reports = {"healthy": RunReport("promoted", seconds=11.9),
               "failing": RunReport("rolled_back", seconds=1.3, failed=4, failed_gates=["error_rate"]),
               "parity": RunReport("rolled_back", seconds=5.5, failed_gates=["parity"])}
    out = io.StringIO()
    Console(file=out, width=60).print(summary(reports, 1200, {"compared": 260, "mismatched": 10}, tmp_path,
                                              tmp_path / "front-metrics.prom"), soft_wrap=True)
    lines = out.getvalue().splitlines()
    assert len(lines) == 4  # one line each, however narrow the screen
    assert "260 mirrored answers compared across layouts, 10 differed" in lines[0]
    assert str(tmp_path / "demo.log") in lines[0] and "spine_shadow_mismatched_total" in lines[0]
    assert [line[:len(start)] for line, start in zip(lines[1:], OUTCOMES, strict=True)] == OUTCOMES
    assert set(RUNS) == set(reports)


def test_the_kept_run_directory_loses_its_secrets(tmp_path: Path) -> None:
    for name in ("admin-token", "spine-config.yaml", "layered/run/config.yaml", "demo.log", "migration.sqlite"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    forget_secrets(tmp_path)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()) == \
        ["demo.log", "migration.sqlite"]


# -- the whole demo (slow) ----------------------------------------------------------------

def _run_dir(first_line: str) -> Path:
    match = re.match(r"log: (\S+)", first_line)
    assert match, first_line
    return Path(match.group(1)).parent


def _mismatches_in_log(log: Path) -> Counter[tuple[str, str]]:
    """(field, calibration) -> DEBUG lines naming it: one line per mismatch."""
    counted: Counter[tuple[str, str]] = Counter()
    for line in log.read_text().splitlines():
        found = re.search(r" spine\.shadow DEBUG shadow mismatch( \(calibration, same layout\))? on ([a-z_, ]+):", line)
        if found:
            for field in found.group(2).split(", "):
                counted[(field, "true" if found.group(1) else "false")] += 1
    return counted


def _mismatches_counted(metrics: Path) -> Counter[tuple[str, str]]:
    counted: Counter[tuple[str, str]] = Counter()
    for family in text_string_to_metric_families(metrics.read_text()):
        for sample in family.samples:
            if sample.name == "spine_shadow_mismatched_total" and sample.value:
                counted[(sample.labels["field"], sample.labels["calibration"])] += int(sample.value)
    return counted


@pytest.mark.slow
def test_make_run_piped_prints_the_tables_and_ends_with_the_three_outcomes() -> None:
    done = subprocess.run([sys.executable, "-m", "spine", "demo"], cwd=REPO, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    lines = done.stdout.splitlines()
    run_dir = _run_dir(lines[0])
    try:
        assert done.returncode == 0, done.stdout[-3000:]
        assert len(lines) < 80, done.stdout
        assert not [line for line in lines if "WARNING" in line or "ERROR" in line]
        assert [line[:len(start)] for line, start in zip(lines[-3:], OUTCOMES, strict=True)] == OUTCOMES
        assert lines[-4].startswith("summary: ")
        in_log, counted = _mismatches_in_log(run_dir / "demo.log"), _mismatches_counted(run_dir / "front-metrics.prom")
        assert in_log == counted and counted[("tokens", "false")] > 0  # the parity run's mismatches, every one
        differed = int(re.search(r"(\d+) differed", lines[-4]).group(1))  # type: ignore[union-attr]
        assert differed == sum(1 for line in (run_dir / "demo.log").read_text().splitlines()
                               if " DEBUG shadow mismatch on " in line)
        assert not (run_dir / "admin-token").exists() and not list(run_dir.rglob("*config.yaml"))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (a terminal to run the demo in)")
def test_in_a_terminal_the_dashboard_stays_up_with_the_three_runs_until_enter(tmp_path: Path) -> None:
    """In tmux, as a person runs it: the dashboard outlives the runs until Enter, and once it
    is closed the summary is the last thing on the screen."""
    server = f"spine-demo-test-{os.getpid()}"  # a tmux server of this test's own
    tmux = ["tmux", "-L", server]
    subprocess.run([*tmux, "new-session", "-d", "-s", "demo", "-x", "160", "-y", "50",
                    f"cd {REPO} && {sys.executable} -m spine demo; echo demo-exit=$?; sleep 600"], check=True)

    def screen() -> str:
        return subprocess.run([*tmux, "capture-pane", "-p", "-J", "-t", "demo", "-S", "-200"], capture_output=True,
                              text=True, check=True).stdout

    def wait_for(needle: str, timeout_s: float) -> str:
        def shown() -> str | None:
            text = screen()
            assert "demo-exit=" not in text, text[-3000:]
            return text if needle in text else None

        return str(eventually(shown, timeout_s, f"{needle!r} on the screen", interval=0.5,
                              seen=lambda: screen()[-3000:]))

    run_dir: Path | None = None
    try:
        text = wait_for("press Enter or Ctrl-C to stop", 600)
        run_dir = _run_dir(text.lstrip())
        url = re.search(r"dashboard still served at (http://\S+)", text).group(1)  # type: ignore[union-attr]
        with urllib.request.urlopen(url + "api/state", timeout=10) as answer:
            runs = json.load(answer)["runs"]
        assert [(run["title"], run["state"]) for run in runs] == [
            ("healthy spine", "promoted"), ("failing spine", "rolled_back"),
            ("spine answering differently", "rolled_back")]
        subprocess.run([*tmux, "send-keys", "-t", "demo", "Enter"], check=True)
        lines = [line for line in wait_for("demo-exit=", 60).splitlines() if line.strip()]
        assert lines[-1] == "demo-exit=0"
        assert lines[-2].startswith(OUTCOMES[2]), lines[-6:]  # the summary is the last thing on the screen
        assert "press Enter" not in "\n".join(lines[-6:])
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)
