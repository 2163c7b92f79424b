"""The one workload generator: what to send (synthetic, reproducible from a seed, or a
recorded trace: `spine.tools.workload.recorded`) and how to send it — closed loop (`closed_loop`: each
worker sends its next request once its last answer is back) or open loop (`open_loop`:
requests released at their arrival offsets, Poisson for synthetic workloads, whether or not
earlier answers are back, so a server that falls behind is charged for the queue it causes).

Used by the demo, the benchmark (its closed-loop cells and the open-loop capacity curve) and
`spine ab`, so every number in this project comes from the same kind of traffic. Every run
is bounded in count and in time.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import grpc

from services.auth.config import AuthConfig
from services.common import ConfigError
from spine.client.gateway_client import CallResult, GatewayClient
from wire.v1 import generation_pb2

W = TypeVar("W")
MAX_TRACE_LINES = 1_000_000  # the most requests a workload (synthetic or a trace) holds
WORDS = ("spine", "gateway", "token", "bucket", "cache", "route", "model", "latency", "batch", "tensor",
         "layer", "collapse", "canary", "stage", "rollback", "parity")


@dataclass(frozen=True)
class Item:
    """One request of a workload, with the credential it is sent with."""

    request: generation_pb2.GenerateRequest
    token: str | None
    stream: bool = False
    headers: tuple[tuple[str, str], ...] = ()


def mixed_workload(count: int, api_key: str, *, seed: int = 7, model: str = "tiny-lm",
                   max_tokens: tuple[int, int] = (4, 16), cacheable_share: float = 0.5,
                   invalid_share: float = 0.05, unauthenticated_share: float = 0.05,
                   stream_share: float = 0.0, repeat_share: float = 0.3) -> list[Item]:
    """A mix of greedy (cacheable), seeded and unseeded sampled, invalid and unauthenticated requests."""
    rng = random.Random(seed)
    items: list[Item] = []
    for index in range(count):
        if items and rng.random() < repeat_share:
            previous = items[rng.randrange(len(items))]
            items.append(previous)  # repeats make cache hits
            continue
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12)))
        request = generation_pb2.GenerateRequest(model=model, prompt=prompt,
                                                 max_tokens=rng.randint(*max_tokens))
        if rng.random() >= cacheable_share:
            request.temperature = 0.8
            request.seed = index
        roll = rng.random()
        token: str | None = api_key
        if roll < invalid_share:
            request.max_tokens = 0
        elif roll < invalid_share + unauthenticated_share:
            token = "not-a-valid-key"
        items.append(Item(request, token, stream=rng.random() < stream_share))
    return items


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


def tenant_keys(auth: AuthConfig) -> dict[str, str]:
    """tenant -> plain API key, for the dev keys an `auth` section carries."""
    keys: dict[str, str] = {}
    for entry in auth.api_keys:
        if entry.key is not None:
            keys.setdefault(entry.tenant, entry.key.get_secret_value())
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


def poisson_offsets(rate_rps: float, duration_s: float, rng: random.Random) -> list[float]:
    """Arrival times in [0, duration_s) of a Poisson process of `rate_rps`."""
    offsets, now = [], rng.expovariate(rate_rps)
    while now < duration_s:
        offsets.append(now)
        now += rng.expovariate(rate_rps)
    return offsets


def closed_loop(count: int, workers: Sequence[W], send: Callable[[W, int], None], time_limit_s: float, *,
                deadline: float | None = None) -> None:
    """Request indexes 0..count-1 handed out in order to one thread per worker, each sending
    its next one as soon as its last answer is back; no index starts after `time_limit_s`
    (or the `deadline`, time.monotonic(), when it is sooner)."""
    deadline = min(time.monotonic() + time_limit_s, deadline if deadline is not None else math.inf)
    next_index = 0
    lock = threading.Lock()

    def loop(worker: W) -> None:
        nonlocal next_index
        while time.monotonic() < deadline:
            with lock:
                index = next_index
                next_index += 1
            if index >= count:
                return
            send(worker, index)

    threads = [threading.Thread(target=loop, args=(worker,), name=f"load-{i}") for i, worker in enumerate(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def open_loop(offsets: Sequence[float], release: Callable[[int, float], None], *, started: float | None = None,
              deadline: float = math.inf) -> int:
    """Open loop: `release(i, scheduled)` at `started + offsets[i]` (time.monotonic(); now by
    default), in order, without waiting for earlier answers — `release` must not block (it
    starts a call: a future, a pool's task). Latency counts from `scheduled`, so a request
    released late is still charged the wait. None released at or after `deadline`; the
    number released."""
    started = time.monotonic() if started is None else started
    for index, offset in enumerate(offsets):
        scheduled = started + offset
        if scheduled >= deadline:
            return index
        delay = scheduled - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        release(index, scheduled)
    return len(offsets)


def run_workload(address: str, items: Sequence[Item], *, concurrency: int = 1, time_limit_s: float = 60.0,
                 on_result: Callable[[int, CallResult], None] | None = None,
                 credentials: grpc.ChannelCredentials | None = None) -> list[CallResult | None]:
    """Send `items` with `concurrency` workers (over TLS with `credentials`); stops by itself
    after `time_limit_s`.

    Results keep the workload's order; a request not sent before the time limit is None.
    """
    results: list[CallResult | None] = [None] * len(items)
    clients = [GatewayClient(address, credentials=credentials) for _ in range(concurrency)]

    def send(client: GatewayClient, index: int) -> None:
        item = items[index]
        headers = dict(item.headers)
        if item.stream:
            result = client.stream(item.request, token=item.token or "", headers=headers)
        else:
            result = client.generate(item.request, token=item.token or "", headers=headers)
        results[index] = result
        if on_result is not None:
            on_result(index, result)

    try:
        closed_loop(len(items), clients, send, time_limit_s)
    finally:
        for client in clients:
            client.close()
    return results
