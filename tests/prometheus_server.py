"""A real Prometheus server for tests: a child process on loopback, scraping given targets.

`make install` provides the `prometheus` binary (the Debian package, with apt-get). Where it
is missing the tests that need it fail and say so: CI has apt-get, so a skip would only hide
a broken install.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

SCRAPE_INTERVAL_S = 0.5


def free_port() -> int:
    """A loopback port free now (Prometheus cannot listen on port 0 and report the real one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PrometheusServer:
    def __init__(self, process: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.process = process
        self.url = url
        self.log = log

    def query(self, promql: str, at: float | None = None) -> list[dict[str, Any]]:
        params = {"query": promql, **({"time": f"{at:.3f}"} if at is not None else {})}
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{urllib.parse.urlencode(params)}", timeout=5) as reply:
            body = json.loads(reply.read())
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    def wait_scraped(self, after: float, targets: int, timeout_s: float = 30.0) -> float:
        """Wait until the latest scrape of each of `targets` targets started after `after` and
        succeeded; the newest of those scrapes' timestamps.

        A failed scrape (a busy machine can take longer than the scrape timeout) marks the
        target's series stale, so a window should end on a round that succeeded."""
        deadline = time.monotonic() + timeout_s
        while True:
            # timestamp() of a selector is its samples' time (of any other expression, the query's)
            stamps = [float(s["value"][1]) for s in self.query("timestamp(up) and up == 1")]
            if len(stamps) >= targets and min(stamps) > after:
                return max(stamps)
            if time.monotonic() > deadline:
                raise AssertionError(f"Prometheus did not scrape {targets} targets successfully after {after:.3f} "
                                     f"within {timeout_s}s (latest successful: {stamps})")
            time.sleep(0.1)


def _require_binary() -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus is not on PATH: `make install` installs it (Debian package `prometheus`, "
                    "apt-get); these tests run a real Prometheus server and cannot do without one")
    return binary


@contextmanager
def run_prometheus(workdir: Path, jobs: Mapping[str, Sequence[str]],
                   scrape_interval_s: float = SCRAPE_INTERVAL_S) -> Iterator[PrometheusServer]:
    """Start Prometheus scraping `jobs` (job name -> HOST:PORT targets), wait until ready, stop it by PID."""
    binary = _require_binary()
    workdir.mkdir(parents=True, exist_ok=True)
    interval = f"{round(scrape_interval_s * 1000)}ms"
    config = {
        "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": "10s"},
        "scrape_configs": [{"job_name": job, "static_configs": [{"targets": list(targets)}]}
                           for job, targets in jobs.items()],
    }
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = workdir / "prometheus.log"
    for _attempt in range(3):  # the free port may be taken between the probe and the bind
        port = free_port()
        with log.open("wb") as out:
            process = subprocess.Popen(
                [binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--web.enable-lifecycle", "--log.level=warn"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        server = PrometheusServer(process, f"http://127.0.0.1:{port}", log)
        try:
            if _wait_ready(server):
                break
        except BaseException:
            _stop(process)
            raise
        _stop(process)
    else:
        raise AssertionError(f"Prometheus did not become ready; its log:\n{log.read_text()[-3000:]}")
    try:
        yield server
    finally:
        _stop(process)


def _wait_ready(server: PrometheusServer, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"{server.url}/-/ready", timeout=2) as reply:
                if reply.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    return False


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
