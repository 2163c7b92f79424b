"""A layout's run directory: where its sockets, logs and config copy live, private to its user."""

from __future__ import annotations

import os
from pathlib import Path


def write_private(run_dir: Path, name: str, text: str) -> Path:
    """Write `name` in `run_dir`, both readable by this user only: the run dir holds the unix
    sockets of the internal links and the config copy holds secrets (API keys, JWT secret)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    run_dir.chmod(0o700)
    path = run_dir / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        os.fchmod(file.fileno(), 0o600)  # also when it existed with wider permissions
        file.write(text)
    return path
