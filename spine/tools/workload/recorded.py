"""Recorded workloads: a JSONL trace, one request per line, in arrival order.

    {"at": 0.031, "prompt": "...", "max_tokens": 8, "model": "tiny-lm", "temperature": 0.0,
     "seed": null, "priority": 0, "token": "<credential or null>", "stream": false, "tenant": "dev"}

`at` is the arrival offset in seconds (open-loop replays keep it; closed-loop runs ignore
it); only `prompt` and `max_tokens` are required. A trace holds the credentials it was
recorded with — synthetic ones use the dev keys of the config — so keep real ones private.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

from services.common.json_object import json_object
from spine.tools.workload.generator import MAX_TRACE_LINES, Entry, Item
from wire.v1 import generation_pb2


class TraceError(ValueError):
    """A trace file that cannot be read or has a bad line (the message names it)."""


def write_trace(path: str | Path, entries: Iterable[Entry]) -> int:
    """Write a JSONL trace; the number of lines written."""
    count = 0
    with Path(path).open("w") as out:
        for entry in entries:
            request = entry.item.request
            line = {
                "at": entry.at, "prompt": request.prompt, "max_tokens": request.max_tokens, "model": request.model,
                "temperature": round(request.temperature, 6),
                "seed": request.seed if request.HasField("seed") else None, "priority": request.priority,
                "token": entry.item.token, "stream": entry.item.stream, "tenant": entry.tenant,
            }
            if entry.item.headers:
                line["headers"] = dict(entry.item.headers)
            out.write(json.dumps(line) + "\n")
            count += 1
    return count


_FIELDS: dict[str, tuple[type, ...]] = {
    "at": (int, float), "prompt": (str,), "max_tokens": (int,), "model": (str,), "temperature": (int, float),
    "seed": (int, type(None)), "priority": (int,), "token": (str, type(None)), "stream": (bool,),
    "tenant": (str,), "headers": (dict,),
}


def read_trace(path: str | Path) -> list[Entry]:
    """Load a JSONL trace; a `TraceError` names the file, the line and what is wrong."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise TraceError(f"cannot read trace file {path}: {error.strerror or error}") from error
    except UnicodeDecodeError as error:
        raise TraceError(f"trace file {path} is not UTF-8 text: {error}") from error
    entries: list[Entry] = []
    previous_at = 0.0
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if len(entries) >= MAX_TRACE_LINES:
            raise TraceError(f"{path}:{number}: more than {MAX_TRACE_LINES} requests; split the trace")
        entry = _parse_line(path, number, line)
        if entry.at < previous_at:
            raise TraceError(f"{path}:{number}: 'at' goes back in time ({entry.at} after {previous_at}); "
                             "a trace is in arrival order")
        previous_at = entry.at
        entries.append(entry)
    if not entries:
        raise TraceError(f"trace file {path} has no requests")
    return entries


def _parse_line(path: str | Path, number: int, line: str) -> Entry:
    where = f"{path}:{number}"
    data = json_object(line, where, TraceError)
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise TraceError(f"{where}: unknown field(s) {unknown}; known: {', '.join(sorted(_FIELDS))}")
    for required in ("prompt", "max_tokens"):
        if required not in data:
            raise TraceError(f"{where}: missing required field {required!r}")
    for name, value in data.items():
        kinds = _FIELDS[name]
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
            expected = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
            raise TraceError(f"{where}: field {name!r} must be {expected}, got {value!r}")
    at = float(data.get("at", 0.0))
    if not math.isfinite(at) or at < 0:
        raise TraceError(f"{where}: field 'at' must be a finite offset >= 0 seconds, got {data['at']!r}")
    request = generation_pb2.GenerateRequest(
        model=data.get("model", "tiny-lm"), prompt=data["prompt"], max_tokens=data["max_tokens"],
        temperature=float(data.get("temperature", 0.0)), priority=data.get("priority", 0))
    if data.get("seed") is not None:
        request.seed = data["seed"]
    headers = data.get("headers") or {}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
        raise TraceError(f"{where}: field 'headers' must map strings to strings")
    item = Item(request, data.get("token"), stream=bool(data.get("stream", False)),
                headers=tuple(sorted(headers.items())))
    return Entry(at, item, str(data.get("tenant", "")))

