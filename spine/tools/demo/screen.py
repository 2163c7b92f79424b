"""What `make run` puts on the screen, and where everything else goes.

The screen is for a person reading the demo: a few lines to say where things are, a live
status line while each run walks its plan (only in a terminal), the three tables and the
summary, which is the last thing on the screen. Everything else — the log lines of this
process (the front's shadow mismatches, one DEBUG line each, the controller's transitions),
and whatever its code or a child that shares its stderr writes there — goes to the run
directory's log file, whose path is printed once; each side's processes log beside it.

In a terminal (stdin and stdout both), the demo ends by keeping its controller and the
dashboard served, with the finished runs' history, until the person presses Enter or
Ctrl-C; without one (CI, a pipe) it ends at once. The screen knows nothing of which legacy
side or which runs the demo compares: it shows what it is given.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import termios
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console, RenderableType
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
PIPE_WIDTH = 140  # the tables' width when stdout is not a terminal (a log, CI)


@contextlib.contextmanager
def logs_in(path: Path) -> Iterator[Path]:
    """Every log line of this process into `path` meanwhile, and file descriptor 2 with them
    (gRPC's C core, a thread's traceback, a child that inherits stderr): `spine.*` at DEBUG
    (what the demo's log keeps: every shadow mismatch, each its own line), the rest at INFO.
    Restored on the way out, so what is printed after (an interrupt's message) reaches the
    terminal again."""
    path.parent.mkdir(parents=True, exist_ok=True)
    root, ours = logging.getLogger(), logging.getLogger("spine")
    saved = (list(root.handlers), root.level, ours.level)
    handler = logging.FileHandler(path, encoding="utf-8")
    assert handler.stream is not None  # opened now (not delayed)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    sys.stderr.flush()
    real_stderr = os.dup(2)
    old_stderr = sys.stderr
    os.dup2(handler.stream.fileno(), 2)  # appends, as the handler does: the lines interleave whole
    sys.stderr = io.TextIOWrapper(os.fdopen(os.dup(2), "wb", buffering=0), encoding="utf-8",
                                  errors="backslashreplace", line_buffering=True, write_through=True)
    root.handlers = [handler]
    root.setLevel(logging.INFO)
    ours.setLevel(logging.DEBUG)
    logging.captureWarnings(True)
    try:
        yield path
    finally:
        logging.captureWarnings(False)
        root.handlers = saved[0]
        root.setLevel(saved[1])
        ours.setLevel(saved[2])
        sys.stderr.flush()
        sys.stderr.close()
        sys.stderr = old_stderr
        os.dup2(real_stderr, 2)
        os.close(real_stderr)
        handler.close()


class DemoScreen:
    """The demo's terminal: `console` (rich) for what is printed, `interactive` when a person
    is at it (stdout and stdin are terminals)."""

    def __init__(self, console: Console | None = None, *, interactive: bool | None = None) -> None:
        self.console = console or Console(width=None if Console().is_terminal else PIPE_WIDTH)
        self.interactive = (self.console.is_terminal and sys.stdin.isatty()) if interactive is None else interactive
        self.log = logging.getLogger("spine.demo")  # what the screen leaves out goes to the log

    def say(self, text: str) -> None:
        """One line on the screen, and in the log."""
        self.log.info("%s", text)
        self.console.print(text, soft_wrap=True, highlight=False)

    def show(self, renderable: RenderableType, *, soft_wrap: bool = False) -> None:
        """A table or the summary on the screen, and as plain text in the log."""
        self.console.print(renderable, soft_wrap=soft_wrap)
        text = io.StringIO()
        Console(file=text, width=PIPE_WIDTH, color_system=None, force_terminal=False).print(renderable,
                                                                                         soft_wrap=soft_wrap)
        self.log.info("\n%s", text.getvalue().rstrip())

    def secret_line(self, text: str) -> None:
        """One line on the screen only, never in the log: it carries a secret (the dashboard's
        link with the admin token in its fragment)."""
        self.console.print(text, soft_wrap=True, highlight=False)

    def note(self, text: str) -> None:
        """Only in the log (the screen shows the run's status line instead)."""
        self.log.info("%s", text)

    @contextlib.contextmanager
    def busy(self, text: str) -> Iterator[None]:
        """A spinner with `text` while something starts or stops (nothing without a terminal)."""
        self.log.info("%s", text)
        if not self.console.is_terminal:  # rich's Live ends with an empty line even where it drew nothing (13)
            yield
            return
        with self.console.status(text):
            yield

    @contextlib.contextmanager
    def run_status(self, title: str) -> Iterator[RunStatus]:
        """A live status line for one run (a spinner, its stage, time elapsed), erased when the
        run ends: its table replaces it. Without a terminal it only writes the log."""
        progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                            console=self.console, transient=True, disable=not self.console.is_terminal)
        task = progress.add_task(title, total=None)
        if not self.console.is_terminal:  # a disabled Progress still ends with an empty line (rich 13)
            yield RunStatus(self, progress, task, title)
            return
        with progress:
            yield RunStatus(self, progress, task, title)

    def keep_open(self, what: str) -> None:
        """Wait, with `what` on a transient line below the summary, until the person presses
        Enter or Ctrl-C (or stdin ends); the summary stays the last thing on the screen."""
        self.log.info("kept open: %s", what)
        with contextlib.suppress(KeyboardInterrupt), _no_echo(), \
                self.console.status(f"{what} — press Enter or Ctrl-C to stop"):
            sys.stdin.readline()
        self.log.info("closed by the person at the terminal")


class RunStatus:
    """One run's live line: `update` with where it stands (also written to the log)."""

    def __init__(self, screen: DemoScreen, progress: Progress, task: Any, title: str) -> None:
        self._screen, self._progress, self._task, self.title = screen, progress, task, title

    def update(self, text: str) -> None:
        self._screen.note(f"[{self.title}] {text}")
        self._progress.update(self._task, description=f"{self.title}: {text}")


@contextlib.contextmanager
def _no_echo() -> Iterator[None]:
    """The terminal does not echo what is typed meanwhile (Enter would move the status line)."""
    try:
        fd = sys.stdin.fileno()
        before = termios.tcgetattr(fd)
    except (OSError, ValueError, termios.error):
        yield
        return
    quiet = list(before)
    quiet[3] &= ~termios.ECHO
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, before)
