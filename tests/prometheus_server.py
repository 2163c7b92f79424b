"""A real Prometheus server for tests: `spine.tools.local_prometheus` (the rehearsal's), plus
what the tests ask of it: queries at a given time, and waiting for a fresh scrape.

`make test` provides the `prometheus` binary (the Debian package, with apt-get). Where it
is missing the tests that need it fail and say so: CI has apt-get, so a skip would only hide
a broken install.
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from runtime.server import free_port
from spine.tools.local_prometheus import LocalPrometheus

SCRAPE_INTERVAL_S = 0.5

__all__ = ["SCRAPE_INTERVAL_S", "PrometheusServer", "free_port", "run_prometheus"]


class PrometheusServer(LocalPrometheus):
    def query(self, promql: str, at: float | None = None) -> list[dict[str, Any]]:
        """The instant query's result, at `at` (Unix seconds) when given."""
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


@contextmanager
def run_prometheus(workdir: Path, jobs: Mapping[str, Sequence[str]],
                   scrape_interval_s: float = SCRAPE_INTERVAL_S) -> Iterator[PrometheusServer]:
    """Start Prometheus scraping `jobs` (job name -> HOST:PORT targets), wait until ready, stop it by PID."""
    if shutil.which("prometheus") is None:
        pytest.fail("prometheus is not on PATH: `make test` installs it (Debian package `prometheus`, "
                    "apt-get); these tests run a real Prometheus server and cannot do without one")
    server = PrometheusServer(workdir, jobs, scrape_interval_s)
    try:
        server.start()
        yield server
    finally:
        server.stop()
