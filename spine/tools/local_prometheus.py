"""A real Prometheus server on loopback for local rehearsals: one scrape job per side.

`make test` and `make rehearse` provide the `prometheus` binary (the Debian package). The server runs as a
child process in its own session, on a port of its own, with its data in a directory the
caller owns, and is stopped by PID.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from runtime.server import free_port


class PrometheusError(RuntimeError):
    pass


def scrape_config(jobs: Mapping[str, Sequence[str]], interval_s: float) -> dict[str, Any]:
    """`jobs`: job name (a side) -> HOST:PORT of every /metrics endpoint of that side."""
    interval = f"{round(interval_s * 1000)}ms"
    return {"global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": "10s"},
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": list(targets)}]}
                               for job, targets in jobs.items()]}


class LocalPrometheus:
    def __init__(self, workdir: Path, jobs: Mapping[str, Sequence[str]], scrape_interval_s: float = 0.5) -> None:
        self.workdir = workdir
        self.jobs = {job: list(targets) for job, targets in jobs.items()}
        self.scrape_interval_s = scrape_interval_s
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.log = workdir / "prometheus.log"

    def start(self, timeout_s: float = 30.0) -> LocalPrometheus:
        binary = shutil.which("prometheus")
        if binary is None:
            raise PrometheusError("prometheus is not on PATH: `make test` installs it (the Debian package "
                                  "`prometheus`, with apt-get)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump(scrape_config(self.jobs, self.scrape_interval_s)))
        for _attempt in range(3):  # the free port may be taken between the probe and the bind
            port = free_port()
            with self.log.open("ab") as out:
                self.process = subprocess.Popen(
                    [binary, f"--config.file={config}", f"--storage.tsdb.path={self.workdir / 'data'}",
                     f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
            self.url = f"http://127.0.0.1:{port}"
            if self._wait_ready(timeout_s):
                return self
            self.stop()
        raise PrometheusError(f"Prometheus did not become ready; its log ({self.log}):\n"
                              f"{self.log.read_text(errors='replace')[-2000:]}")

    def _wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as reply:
                    if reply.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        return False

    def query(self, promql: str) -> list[dict[str, Any]]:
        params = urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{params}", timeout=5) as reply:
            body = json.loads(reply.read())
        if body.get("status") != "success":
            raise PrometheusError(f"query {promql!r}: {body}")
        return list(body["data"]["result"])

    def targets_up(self) -> dict[str, int]:
        """Job -> how many of its targets the last scrape reached."""
        up: dict[str, int] = {}
        for sample in self.query("up == 1"):
            job = sample["metric"].get("job", "")
            up[job] = up.get(job, 0) + 1
        return up

    def wait_all_up(self, timeout_s: float = 30.0) -> None:
        want = {job: len(targets) for job, targets in self.jobs.items()}
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                up = self.targets_up()
            except (urllib.error.URLError, OSError, PrometheusError):
                up = {}
            if all(up.get(job, 0) >= count for job, count in want.items()):
                return
            if time.monotonic() > deadline:
                raise PrometheusError(f"Prometheus did not reach every target within {timeout_s:g}s: up {up}, "
                                      f"wanted {want}")
            time.sleep(0.2)

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
