"""Waiting for a server process's `ready` line: one JSON object on its stdout.

`spine up` and `spine.tools.ab.serve` print `{"event": "ready", "address": …}` once they
serve (or `{"event": "failed", …}`); whoever starts one as a child waits for that line with
a deadline, without blocking past it on a child that prints nothing.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import time
from collections.abc import Collection
from typing import Any


def first_event(process: subprocess.Popen[bytes], deadline: float,
                events: Collection[str] = ("ready", "failed")) -> dict[str, Any] | None:
    """The first JSON line on `process`'s stdout whose `event` is one of `events` (other
    lines are skipped); None when the process exits or `deadline` (time.monotonic()) passes
    first."""
    assert process.stdout is not None, "start the process with stdout=subprocess.PIPE"
    buffer = b""
    while time.monotonic() < deadline:
        readable, _, _ = select.select([process.stdout], [], [], 0.2)
        if not readable:
            if process.poll() is not None:
                return None
            continue
        chunk = os.read(process.stdout.fileno(), 65536)
        if not chunk:
            return None  # exited
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            event = _json_object(line)
            if event.get("event") in events:
                return event
    return None


def _json_object(line: bytes) -> dict[str, Any]:
    try:
        value = json.loads(line.decode(errors="replace"))
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
