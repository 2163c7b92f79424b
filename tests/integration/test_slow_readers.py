"""A client that does not read its stream cannot make the server buffer the answer.

`spine up` in a process of its own (its memory is what is measured), in both layouts, in front
of an upstream that streams 1 KiB events as fast as it is read (`tests.fault_upstream`'s
`firehose`). A client asks for the stream and never reads a byte: the server reads the
upstream only as far as its bounded windows (the connection's buffer, the HTTP layer's, the
upstream's queue; the gRPC stream's flow control in the layered layout) let it, then once
the client has taken nothing for `http.stream_stall_s` it cancels the request, drops the
upstream's connection, and counts it (`spine_requests_total{status="SLOW_READER"}`). Without
the bounds the server grew by some 400 MB a second until the request's deadline."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml

from runtime.config.file import load_config
from runtime.processes.launch import launch, spine_up_argv
from tests.conftest import DEV_KEY
from tests.fault_upstream import FaultUpstream
from tests.waiting import eventually

STALL_S = 2.0
GROWTH_BOUND = 100 << 20  # far below what the unbounded server grew in the same time (~800 MB)


@pytest.fixture(scope="module")
def firehose(bare_http_upstream: Any) -> Iterator[FaultUpstream]:
    upstream = FaultUpstream(bare_http_upstream.base_url, bare_http_upstream.key).start()
    try:
        yield upstream
    finally:
        upstream.stop()


@contextlib.contextmanager
def spine_up(layout: str, tmp: Path, upstream: FaultUpstream) -> Iterator[tuple[psutil.Process, str, Path]]:
    """`spine up --layout LAYOUT` with a `firehose` model; (its process, HTTP address, run dir)."""
    models = [model.model_dump(mode="json", exclude_none=True) for model in load_config().router.models]
    config = tmp / "spine.yaml"
    config.write_text(yaml.safe_dump({
        "http": {"stream_stall_s": STALL_S},
        "router": {"models": [*models, {"id": "firehose", "upstream": {"base_url": upstream.base_url,
                                                                      "model": "firehose", "retries": 0}}]}}))
    run_dir = tmp / "run"
    launched = launch("spine up", spine_up_argv(config, layout, listen="127.0.0.1:0", http_listen="127.0.0.1:0",
                                                run_dir=run_dir), log_path=tmp / "spine.log")
    try:
        ready = launched.wait_ready(120)
        yield psutil.Process(launched.pid), str(ready["http_address"]), run_dir
    finally:
        launched.stop()


def tree_rss(process: psutil.Process) -> int:
    """The resident memory of the server and every process it started (the layered children)."""
    total = 0
    for each in (process, *process.children(recursive=True)):
        with contextlib.suppress(psutil.Error):
            total += each.memory_info().rss
    return total


def slow_readers(run_dir: Path) -> float:
    """spine_requests_total{status="SLOW_READER"}, summed, from the layout's /metrics."""
    address = (run_dir / "metrics.addr").read_text().strip()
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as answer:  # noqa: S310 - loopback
        text = answer.read().decode()
    return sum(float(value) for value in
               re.findall(r'^spine_requests_total\{[^}]*status="SLOW_READER"[^}]*\} (\S+)$', text, re.MULTILINE))


def ask_and_never_read(address: str) -> socket.socket:
    """A stream request on a socket with a small receive buffer, whose answer is never read."""
    host, port = address.rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    body = json.dumps({"model": "firehose", "max_tokens": 200, "stream": True,
                       "messages": [{"role": "user", "content": "everything"}]}).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: spine\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + DEV_KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    return sock


@pytest.mark.parametrize("layout", ["collapsed", "layered"])
def test_a_client_that_never_reads_keeps_memory_bounded_and_is_cancelled(
        layout: str, firehose: FaultUpstream, tmp_path: Path) -> None:
    with spine_up(layout, tmp_path, firehose) as (server, address, run_dir):
        with httpx.Client(base_url=f"http://{address}", timeout=30) as client:  # warm: a stream read whole
            answer = client.post("/v1/chat/completions", headers={"authorization": f"Bearer {DEV_KEY}"},
                                 json={"model": "default", "max_tokens": 4, "stream": True,
                                       "messages": [{"role": "user", "content": "warm"}]})
            assert answer.status_code == 200, answer.text
        baseline = peak = tree_rss(server)
        left_before = firehose.left["firehose"]
        sock = ask_and_never_read(address)
        try:
            def counted() -> bool:
                nonlocal peak
                peak = max(peak, tree_rss(server))
                return slow_readers(run_dir) >= 1
            eventually(counted, 60, "the stalled stream counted as SLOW_READER", interval=0.05)
            eventually(lambda: firehose.left["firehose"] > left_before, 20, "the upstream's stream closed")
        finally:
            sock.close()
        assert peak - baseline < GROWTH_BOUND, f"the server grew {(peak - baseline) >> 20} MiB"
        with httpx.Client(base_url=f"http://{address}", timeout=30) as client:  # still serving
            answer = client.post("/v1/chat/completions", headers={"authorization": f"Bearer {DEV_KEY}"},
                                 json={"model": "default", "max_tokens": 2,
                                       "messages": [{"role": "user", "content": "after"}]})
            assert answer.status_code == 200, answer.text
