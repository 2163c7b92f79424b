"""`spine demo` stopped by an operator: SIGTERM or Ctrl-C stops everything it started.

Python's own SIGTERM ends a process at once, with no `finally`: the demo's layered stack,
its spine and its traffic process were left running (seen: a layered stack and the traffic
process still up after the demo was gone). The demo now unwinds on SIGTERM as on Ctrl-C.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from tests.waiting import eventually

REPO = Path(__file__).resolve().parents[2]


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_sigterm_to_the_demo_alone_stops_every_process_it_started(tmp_path: Path) -> None:
    """SIGTERM only: Ctrl-C takes the same path once SIGTERM is turned into it (22 s a case)."""
    log = tmp_path / "demo.out"
    with open(log, "w") as out:
        # A new session: the signal goes to the demo's PID alone, as `kill PID` sends it,
        # not to a process group as a terminal's Ctrl-C would.
        demo = subprocess.Popen([sys.executable, "-m", "spine", "demo"], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    demo_log: Path | None = None
    try:
        # Its first line names its log, where each stage is written as the run enters it.
        def first_stage() -> bool:
            nonlocal demo_log
            assert demo.poll() is None, log.read_text(errors="replace")[-2000:]
            first = log.read_text(errors="replace").partition("\n")[0]
            if demo_log is None and first.startswith("log: "):
                demo_log = Path(first.removeprefix("log: ").split(" (")[0])
            return demo_log is not None and "stage 1/4" in demo_log.read_text(errors="replace")

        eventually(first_stage, 90, "the demo at its first stage", interval=0.2)
        started = psutil.Process(demo.pid).children(recursive=True)
        assert len(started) >= 3  # the layered stack, the spine, the traffic process (and more)
        os.kill(demo.pid, signal.SIGTERM)
        assert demo.wait(timeout=60) == 130
        assert "interrupted: both layouts, the controller and the traffic were stopped" in log.read_text()
        # Stopped by the demo, not left to their parent-death signal (the stack takes seconds
        # to stop that way); multiprocessing's resource tracker leaves once its pipe closes.
        eventually(lambda: not _alive(started), 2.0, "every process the demo started gone", interval=0.1,
                   seen=lambda: [" ".join(p.cmdline())[:120] for p in _alive(started)])
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait(timeout=10)
        for process in _alive(psutil.Process().children(recursive=True)):
            process.kill()
        if demo_log is not None:  # the demo keeps its run directory for a person to read
            shutil.rmtree(demo_log.parent, ignore_errors=True)


def test_an_interrupt_reaches_a_command_started_with_sigint_ignored() -> None:
    """A script's `spine demo &` starts it with SIGINT ignored (POSIX), which Python keeps:
    `kill -INT` did nothing. `sigterm_as_interrupt` takes SIGINT back then, and both signals
    unwind the command (its `finally` runs), one process each."""
    child = ("import signal, sys, time\n"
             "from runtime.processes.signals import sigterm_as_interrupt\n"
             "assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN\n"
             "try:\n"
             "    with sigterm_as_interrupt():\n"
             "        print('ready', flush=True)\n"
             "        time.sleep(30)\n"
             "except KeyboardInterrupt:\n"
             "    print('unwound', flush=True)\n"
             "    sys.exit(130)\n")
    for signum in (signal.SIGINT, signal.SIGTERM):
        # Started as a background job is: SIGINT ignored from the start (inherited over exec).
        starter = f"import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); os.execv(sys.executable, [sys.executable, '-c', {child!r}])"
        process = subprocess.Popen([sys.executable, "-c", starter], cwd=REPO, stdout=subprocess.PIPE, text=True)
        try:
            assert process.stdout is not None and process.stdout.readline() == "ready\n"
            process.send_signal(signum)
            assert process.wait(timeout=20) == 130, signum
            assert process.stdout.read() == "unwound\n"
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
