"""A/B workloads: synthetic ones from a seed, or a recorded JSONL trace.

A trace is one JSON object per line, in arrival order:

    {"at": 0.031, "prompt": "...", "max_tokens": 8, "model": "tiny-lm", "temperature": 0.0,
     "seed": null, "priority": 0, "token": "<credential or null>", "stream": false, "tenant": "dev"}

`at` is the arrival offset in seconds (open-loop replays keep it; closed-loop runs ignore
it); only `prompt` and `max_tokens` are required. A trace holds the credentials it was
recorded with — synthetic ones use the dev keys of the config — so keep real ones private.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common import ConfigError
from spine.tools.workload import WORDS, Item
from wire.v1 import generation_pb2

MAX_TRACE_LINES = 1_000_000


class TraceError(ValueError):
    """A trace file that cannot be read or has a bad line (the message names it)."""


@dataclass(frozen=True)
class Entry:
    """One request of a workload and when it arrives."""

    at: float
    item: Item
    tenant: str = ""


@dataclass(frozen=True)
class SyntheticSpec:
    """Distributions a synthetic workload is drawn from (all bounded, all seeded)."""

    count: int = 200
    seed: int = 7
    model: str = "tiny-lm"
    prompt_words: tuple[int, int] = (2, 24)      # log-uniform between the bounds
    max_tokens: tuple[int, int] = (4, 16)        # log-uniform between the bounds
    tenants: Mapping[str, float] = field(default_factory=dict)  # tenant -> weight; {} = every dev tenant alike
    cacheable_share: float = 0.5                 # greedy or seeded, so the answer can be cached
    repeat_share: float = 0.3                    # an earlier request sent again (cache hits)
    unauthenticated_share: float = 0.02
    invalid_share: float = 0.02                  # max_tokens 0: refused by validation
    stream_share: float = 0.0
    rate: float = 20.0                           # mean arrivals per second (Poisson) for open loop
    burst_every_s: float = 0.0                   # 0 = no bursts
    burst_size: int = 0                          # extra requests arriving at once at each burst

    def __post_init__(self) -> None:
        if not 1 <= self.count <= MAX_TRACE_LINES:
            raise ConfigError(f"count: must be from 1 to {MAX_TRACE_LINES}, got {self.count}")
        for name in ("prompt_words", "max_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ConfigError(f"{name}: need 1 <= min <= max, got {low}:{high}")
        for name in ("cacheable_share", "repeat_share", "unauthenticated_share", "invalid_share", "stream_share"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"{name}: must be between 0 and 1, got {value}")
        if self.rate <= 0:
            raise ConfigError(f"rate: must be > 0 requests per second, got {self.rate}")
        if self.burst_every_s < 0 or self.burst_size < 0:
            raise ConfigError(f"bursts: need burst_every_s >= 0 and burst_size >= 0, got "
                              f"{self.burst_every_s} and {self.burst_size}")
        if any(weight < 0 for weight in self.tenants.values()) or (self.tenants and not sum(self.tenants.values())):
            raise ConfigError(f"tenants: weights must be >= 0 with a positive sum, got {dict(self.tenants)}")


def tenant_keys(config: Mapping[str, Any]) -> dict[str, str]:
    """tenant -> plain API key, for the dev keys a config carries."""
    keys: dict[str, str] = {}
    for entry in (config.get("auth") or {}).get("api_keys") or []:
        if isinstance(entry, Mapping) and entry.get("key") and entry.get("tenant"):
            keys.setdefault(str(entry["tenant"]), str(entry["key"]))
    return keys


def synthetic(spec: SyntheticSpec, keys: Mapping[str, str]) -> list[Entry]:
    """A workload drawn from `spec`, with credentials from `keys` (tenant -> key)."""
    weights = dict(spec.tenants) or dict.fromkeys(keys, 1.0)
    missing = sorted(set(weights) - set(keys))
    if missing:
        raise ConfigError(f"tenants: no dev API key for {missing} in the config; known: {sorted(keys)}")
    if not weights:
        raise ConfigError("tenants: the config has no dev API key (auth.api_keys[].key) to send requests with")
    names = sorted(weights)
    rng = random.Random(spec.seed)
    entries: list[Entry] = []
    clock = 0.0
    next_burst = spec.burst_every_s if spec.burst_every_s > 0 else math.inf
    pending_burst = 0
    for index in range(spec.count):
        if pending_burst:
            pending_burst -= 1  # arrives with the burst, at the same instant
        else:
            clock += rng.expovariate(spec.rate)
            if clock >= next_burst:
                clock = next_burst
                next_burst += spec.burst_every_s
                pending_burst = spec.burst_size
        if entries and rng.random() < spec.repeat_share:
            previous = entries[rng.randrange(len(entries))]
            entries.append(Entry(round(clock, 6), previous.item, previous.tenant))
            continue
        tenant = rng.choices(names, weights=[weights[n] for n in names])[0]
        words = _log_uniform(rng, *spec.prompt_words)
        request = generation_pb2.GenerateRequest(
            model=spec.model, prompt=" ".join(rng.choice(WORDS) for _ in range(words)),
            max_tokens=_log_uniform(rng, *spec.max_tokens))
        if rng.random() >= spec.cacheable_share:
            request.temperature = 0.8
            if rng.random() < 0.5:
                request.seed = index  # seeded sampling: still one right answer
        token: str | None = keys[tenant]
        roll = rng.random()
        if roll < spec.invalid_share:
            request.max_tokens = 0
        elif roll < spec.invalid_share + spec.unauthenticated_share:
            token, tenant = "not-a-valid-key", ""
        entries.append(Entry(round(clock, 6), Item(request, token, stream=rng.random() < spec.stream_share), tenant))
    return entries


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    return min(high, int(math.exp(rng.uniform(math.log(low), math.log(high + 1)))))


# -- traces ------------------------------------------------------------------------
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
    try:
        data = json.loads(line)
    except json.JSONDecodeError as error:
        raise TraceError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(data, dict):
        raise TraceError(f"{where}: each line must be a JSON object, got {type(data).__name__}")
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

