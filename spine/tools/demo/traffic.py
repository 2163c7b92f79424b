"""The demo's traffic (`make run`): the workload's mixed requests through the front, from a
child process, in batches, a share of each over the HTTP API; counted as they come back."""

from __future__ import annotations

import multiprocessing
import os
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from runtime.config.sections import TlsConfig
from runtime.processes.parent import die_with_parent
from runtime.tls import link_credentials
from spine.tools.workload.generator import Item, mixed_workload, run_workload
from spine.tools.workload.http import FAILED, run_http_workload

FAILURE_CODES = ("UNAVAILABLE", "INTERNAL", "UNKNOWN")  # a layout failed (not the client's own fault)
FAILURES_KEPT = 5


HTTP_SHARE = 4  # every 4th request of a batch goes over the HTTP API (when the front serves one)


def traffic_batches(address: str, api_key: str, concurrency: int, time_limit_s: float,
                    credentials: grpc.ChannelCredentials | None,
                    stop: Any, http_address: str | None = None,
                    tls: TlsConfig | None = None, model: str = "tiny-lm") -> Iterator[tuple[int, int, list[str]]]:
    """Send batches of the mixed workload until `stop` is set or the time is up; per batch,
    (requests answered, requests a layout failed, the first few failures as "CODE: details").
    With `http_address`, a quarter of each batch goes there as OpenAI and Anthropic HTTP calls
    (a layout failed it: a 5xx, or no answer)."""
    deadline = time.monotonic() + time_limit_s
    batch = 0
    http_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="http-traffic")
    while not stop.is_set() and time.monotonic() < deadline:
        items = [Item(i.request, i.token, i.stream, (("x-session-id", f"session-{batch}-{n % 40}"),))
                 for n, i in enumerate(mixed_workload(40, api_key, seed=batch, max_tokens=(2, 6), model=model,
                                                      invalid_share=0.0, unauthenticated_share=0.02))]
        # Over HTTP, every other one streamed (server-sent events), as chat clients do.
        over_http = [Item(i.request, i.token, n % 2 == 1, i.headers)
                     for n, i in enumerate(items[::HTTP_SHARE])] if http_address else []
        over_grpc = [item for n, item in enumerate(items) if not (http_address and n % HTTP_SHARE == 0)]
        http_call = None
        if over_http and http_address:  # beside the gRPC part, on a thread of its own
            http_call = http_pool.submit(run_http_workload, http_address, over_http, concurrency=1, tls=tls,
                                         time_limit_s=max(0.1, deadline - time.monotonic()))
        results = run_workload(address, over_grpc, concurrency=concurrency,
                               time_limit_s=max(0.1, deadline - time.monotonic()), credentials=credentials)
        http_statuses = http_call.result() if http_call is not None else []
        done = [r for r in results if r is not None]
        failures = [f"{r.code.name}: {r.details}" for r in done if r.code.name in FAILURE_CODES]
        answered = [status for status in http_statuses if status is not None]
        failures += [f"HTTP {status}" for status in answered if status >= 500 or status == FAILED]
        yield len(done) + len(answered), len(failures), failures[:FAILURES_KEPT]
        batch += 1
    http_pool.shutdown(wait=False)


def _drive_in_child(address: str, api_key: str, concurrency: int, time_limit_s: float, tls: TlsConfig | None,
                    stop: Any, counts: Any, http_address: str | None = None, model: str = "tiny-lm") -> None:
    """The traffic process's body: `traffic_batches`, each batch's counts put on `counts`.
    It ends with the demo, however the demo ends (SIGKILL included): no traffic from an orphan."""
    die_with_parent()
    if os.getppid() == 1:  # the demo died before the line above took effect
        return
    for counts_of_batch in traffic_batches(address, api_key, concurrency, time_limit_s,
                                           link_credentials(tls, address), stop, http_address, tls, model):
        counts.put(counts_of_batch)
    counts.put(None)


class TrafficDriver:
    """Synthetic traffic through the front until stopped (bounded in time regardless).

    With `own_process` the clients run in a process of their own (spawned): in this one they
    would take the GIL from the front, which both sides' requests pass, and the stage tables
    would time the traffic generator as much as the layouts."""

    def __init__(self, address: str, api_key: str, concurrency: int = 4, time_limit_s: float = 110.0,
                 credentials: grpc.ChannelCredentials | None = None, *, own_process: bool = False,
                 tls: TlsConfig | None = None, http_address: str | None = None, model: str = "tiny-lm") -> None:
        self.address = address
        self.http_address = http_address  # a quarter of the traffic goes there over HTTP
        self.model = model  # what the requests ask for: the config's served model
        self.credentials = credentials  # the front speaks TLS when the config has `tls:`
        self.tls = tls  # how the traffic process makes its credentials (`own_process`)
        self.api_key = api_key
        self.concurrency = concurrency
        self.time_limit_s = time_limit_s
        self.own_process = own_process
        self.sent = 0
        self.failed = 0
        self.failures: list[str] = []  # the first few failures, "CODE: details" (what a test reports)
        self.batches = 0  # counts are added a batch at a time, when a batch has finished
        self._child: Any = None
        if own_process:
            context = multiprocessing.get_context("spawn")  # no fork of this process's gRPC threads
            self.stop: Any = context.Event()
            self._counts: Any = context.Queue()
            self._child = context.Process(target=_drive_in_child, name="traffic", daemon=True,
                                          args=(address, api_key, concurrency, time_limit_s, tls, self.stop,
                                                self._counts, http_address, model))
            self._thread = threading.Thread(target=self._collect, name="traffic-counts", daemon=True)
        else:
            self.stop = threading.Event()
            self._thread = threading.Thread(target=self._run, name="traffic", daemon=True)

    def start(self) -> None:
        if self._child is not None:
            self._child.start()
        self._thread.start()

    def _run(self) -> None:
        for sent, failed, failures in traffic_batches(self.address, self.api_key, self.concurrency,
                                                      self.time_limit_s, self.credentials, self.stop,
                                                      self.http_address, self.tls, self.model):
            self._count(sent, failed, failures)

    def _collect(self) -> None:
        """The traffic process's counts, batch by batch, until it ends."""
        while True:
            try:
                counts = self._counts.get(timeout=0.5)
            except queue.Empty:
                if not self._child.is_alive():
                    return
                continue
            if counts is None:
                return
            self._count(*counts)

    def _count(self, sent: int, failed: int, failures: list[str]) -> None:
        self.sent += sent
        self.failed += failed
        self.failures.extend(failures[:FAILURES_KEPT - len(self.failures)])
        self.batches += 1

    def settle(self, timeout_s: float = 5.0) -> None:
        """Wait until the batch in flight now has been counted, so what it met is counted
        with the run it was sent in, not the next one."""
        seen = self.batches
        deadline = time.monotonic() + timeout_s
        while self.batches == seen and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)

    def close(self) -> None:
        self.stop.set()
        self._thread.join(timeout=30)
        if self._child is not None:
            self._child.join(timeout=5)
            if self._child.is_alive():
                self._child.kill()
                self._child.join(timeout=5)
