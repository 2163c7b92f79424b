"""The controller's log under traffic keeps to its own lines: the HTTP front it serves between a
foreign gateway and the spine proxies every request with an HTTP client whose library would log
one INFO line each ("HTTP Request: POST …"); a few hundred requests leave a few lines, not
hundreds.

Real processes on 127.0.0.1: the controller (`python -m migration.runner --target legacy-http`)
and two OpenAI-compatible servers standing in for the two gateways (`tests.fault_upstream`)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from migration.testing import ADMIN_TOKEN
from runtime.processes.parent import spawn
from runtime.server import free_port
from tests.fault_upstream import FaultUpstream

ROOT = Path(__file__).resolve().parents[2]
REQUESTS = 200


def test_the_controller_logs_a_few_lines_for_hundreds_of_proxied_requests(tmp_path: Path) -> None:
    legacy = FaultUpstream("http://127.0.0.1:9/v1", None).start()
    spine = FaultUpstream("http://127.0.0.1:9/v1", None).start()
    token = tmp_path / "token"
    token.write_text(ADMIN_TOKEN + "\n")
    token.chmod(0o600)
    front = f"127.0.0.1:{free_port()}"
    sockets = tempfile.mkdtemp(prefix="log", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k != "SPINE_ADMIN_TOKEN"}
    process = spawn([sys.executable, "-m", "migration.runner", "--db", str(tmp_path / "m.db"), "--listen",
                     f"unix:{sockets}/c.sock", "--admin-token-file", str(token), "--target", "legacy-http",
                     "--legacy-http", f"http://127.0.0.1:{legacy.port}", "--spine-http",
                     f"http://127.0.0.1:{spine.port}", "--front-listen", front],
                    cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stderr is not None
        for line in process.stderr:  # up once it says where its front listens
            if "HTTP front on" in line:
                break
        else:
            raise AssertionError("the controller ended before its front was up")
        with httpx.Client(base_url=f"http://{front}", timeout=10) as client:
            for number in range(REQUESTS):
                answer = client.post("/v1/chat/completions", headers={"authorization": "Bearer k"},
                                     json={"model": "brief", "max_tokens": 1,
                                           "messages": [{"role": "user", "content": f"hi {number}"}]})
                assert answer.status_code == 200, answer.text
        assert legacy.hits["brief"] + spine.hits["brief"] == REQUESTS
        process.send_signal(signal.SIGTERM)
        rest = process.stderr.read()
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
        legacy.stop()
        spine.stop()
    lines = rest.splitlines()
    assert not [line for line in lines if re.search(r"HTTP Request|httpx|httpcore", line)]
    assert len(lines) < 10, lines
