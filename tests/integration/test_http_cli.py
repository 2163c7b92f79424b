"""`spine up` refuses an HTTP listener off loopback (its ready line's `http_address` and the SDKs'
answers are checked where `spine up` is tested: tests/integration/test_faults_and_cli.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_http_listen_off_loopback_is_refused_before_anything_starts(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "spine", "up", "--layout", "layered", "--listen", "127.0.0.1:0",
                          "--http-listen", "0.0.0.0:0", "--run-dir", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "not loopback" in run.stderr and not (tmp_path / "run").exists()
